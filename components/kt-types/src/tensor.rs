//! GPU data: tensors and state dicts.
//!
//! A *tensor set* is an ordered list of named tensors: a single tensor is a
//! set of one entry named `""`, a state dict is a set of many. Applications
//! keep their memory; they register it with their pod's node agent by a
//! memory handle (a CUDA IPC handle, or a shared-memory file on the host
//! backend) over the control socket ([`crate::agent`], version 2). The agent
//! moves the bytes: peer to peer from the producer's agent, or in one
//! coordinated transfer planned by the metadata server's quorum
//! (`/api/v1/quorums/...`, the types below).
//!
//! Every transfer, point-to-point or broadcast, is a [`TransferPlan`]: ranks
//! (one per process taking part: several processes of a pod each take their
//! own, sharing their pod's agent), and flows (a source rank sends one key's
//! tensors to some receiver ranks; a key several putters put is a flow per
//! putter). Backends (one per [`BackendKind`]) implement one
//! collective, a broadcast within a subset of ranks; `pack` turns a set's
//! tensors into a few large buffers (one dtype each, bounded buckets)
//! instead of one collective per tensor.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::Key;
use crate::api::PutOptions;
use crate::model::{BroadcastWindow, KeyRecord};

/// Most dimensions a tensor may have.
pub const MAX_DIMS: usize = 16;
/// Largest single tensor (bytes).
pub const MAX_TENSOR_BYTES: u64 = 1 << 40;
/// Most tensors in one set.
pub const MAX_TENSORS: usize = 1 << 20;
/// Longest tensor name (a state dict's parameter path).
pub const MAX_NAME_LEN: usize = 1024;
/// Default size of a pack bucket: large enough to amortise a collective,
/// small enough that two (double buffering) fit beside the model.
pub const DEFAULT_BUCKET_BYTES: u64 = 256 << 20;
/// Smallest pack bucket accepted.
pub const MIN_BUCKET_BYTES: u64 = 1 << 20;
/// Default fanout of a host-backend broadcast tree (NCCL picks its own).
pub const DEFAULT_GPU_FANOUT: u32 = 2;
/// Default quorum window (seconds) when neither world size nor ips close it.
pub const DEFAULT_QUORUM_TIMEOUT_SECS: f64 = 30.0;
/// Longest quorum window (seconds): a round is answered by then at the latest.
pub const MAX_QUORUM_TIMEOUT_SECS: f64 = 3600.0;

/// Element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// `f64`: 64-bit IEEE 754 float (`torch.float64`).
    F64,
    /// `f32`: 32-bit IEEE 754 float (`torch.float32`).
    F32,
    /// `f16`: 16-bit IEEE 754 float (`torch.float16`).
    F16,
    /// `bf16`: bfloat16 (`torch.bfloat16`).
    Bf16,
    /// `f8e4m3`: 8-bit float, 4 exponent and 3 mantissa bits
    /// (`torch.float8_e4m3fn`).
    F8e4m3,
    /// `f8e5m2`: 8-bit float, 5 exponent and 2 mantissa bits
    /// (`torch.float8_e5m2`).
    F8e5m2,
    /// `i64`: signed 64-bit integer.
    I64,
    /// `i32`: signed 32-bit integer.
    I32,
    /// `i16`: signed 16-bit integer.
    I16,
    /// `i8`: signed 8-bit integer.
    I8,
    /// `u8`: unsigned 8-bit integer.
    U8,
    /// `bool`: one byte per element.
    Bool,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 12] = [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::F8e4m3,
        DType::F8e5m2,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U8,
        DType::Bool,
    ];

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::Bf16 | DType::I16 => 2,
            DType::F8e4m3 | DType::F8e5m2 | DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The name on the wire (`f32`, `bf16`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F8e4m3 => "f8e4m3",
            DType::F8e5m2 => "f8e5m2",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::I16 => "i16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // PyTorch's names too, so a Python client can pass `str(t.dtype)`.
        let s = s.strip_prefix("torch.").unwrap_or(s);
        let d = match s {
            "float64" | "double" => DType::F64,
            "float32" | "float" => DType::F32,
            "float16" | "half" => DType::F16,
            "bfloat16" => DType::Bf16,
            "float8_e4m3fn" => DType::F8e4m3,
            "float8_e5m2" => DType::F8e5m2,
            "int64" | "long" => DType::I64,
            "int32" | "int" => DType::I32,
            "int16" | "short" => DType::I16,
            "int8" => DType::I8,
            "uint8" => DType::U8,
            other => DType::ALL
                .into_iter()
                .find(|d| d.as_str() == other)
                .ok_or_else(|| format!("unknown dtype {other:?}"))?,
        };
        Ok(d)
    }
}

/// Where a tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory: `cpu` on the wire.
    Cpu,
    /// A GPU, by its index as the application numbers it: `cuda:N` on the
    /// wire (`cuda` alone reads as `cuda:0`).
    Cuda(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|i| i.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device {s:?} (cpu, cuda, cuda:N)")),
        }
    }
}

impl Serialize for Device {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Device {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Dtype and shape: what must match between a source and a destination.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorMeta {
    /// The element type.
    pub dtype: DType,
    /// Dimensions, outermost first, at most [`MAX_DIMS`]; empty for a
    /// scalar.
    pub shape: Vec<u64>,
}

impl TensorMeta {
    /// The meta of a `dtype` tensor of this shape.
    pub fn new(dtype: DType, shape: impl Into<Vec<u64>>) -> Self {
        TensorMeta {
            dtype,
            shape: shape.into(),
        }
    }

    /// Bytes of the tensor, or why it is not a valid tensor.
    pub fn nbytes(&self) -> Result<u64, String> {
        if self.shape.len() > MAX_DIMS {
            return Err(format!(
                "{} dimensions, more than {MAX_DIMS}",
                self.shape.len()
            ));
        }
        let n = self
            .shape
            .iter()
            .try_fold(self.dtype.size(), |acc, d| acc.checked_mul(*d))
            .filter(|n| *n <= MAX_TENSOR_BYTES)
            .ok_or_else(|| format!("{self} is larger than {MAX_TENSOR_BYTES} bytes"))?;
        Ok(n)
    }
}

impl fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.shape.iter().map(u64::to_string).collect();
        write!(f, "{}[{}]", self.dtype, dims.join(", "))
    }
}

/// Memory an application lends its agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MemHandle {
    /// A file in the agent's shared-memory directory (`KT_SHM_DIR`, default
    /// `/dev/shm`), mapped by both sides: bytes `[offset, offset + len)`.
    Shm {
        /// Absolute path of a regular file inside that directory, reached
        /// without symlinks.
        path: String,
        /// Offset in bytes of the tensor in the file.
        offset: u64,
        /// Bytes of the tensor.
        len: u64,
    },
    /// A CUDA IPC handle (`cuIpcGetMemHandle`, 64 bytes, hex) of the
    /// allocation that holds the tensor at `offset`, on the GPU of this UUID
    /// (`GPU-…`, as `nvidia-smi -L` prints it): the application's and the
    /// agent's containers may number the node's GPUs differently, so the
    /// agent finds the device by UUID (by the entry's index without one).
    CudaIpc {
        /// The IPC handle of the allocation, 64 bytes as hex.
        handle: String,
        /// Offset in bytes of the tensor from the allocation's start.
        offset: u64,
        /// Bytes of the tensor.
        len: u64,
        /// The GPU's UUID; absent: the device is found by the entry's
        /// index.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device_uuid: Option<String>,
    },
}

impl MemHandle {
    /// Bytes lent: must equal the tensor's size ([`TensorMeta::nbytes`]).
    pub fn len(&self) -> u64 {
        match self {
            MemHandle::Shm { len, .. } | MemHandle::CudaIpc { len, .. } => *len,
        }
    }

    /// True when no byte is lent (a tensor with a zero dimension).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One registered tensor: name, dtype and shape, device, memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// `""` for a single tensor; a state dict's parameter name otherwise.
    pub name: String,
    /// Dtype and shape, flattened: `dtype` and `shape` sit beside `name`.
    #[serde(flatten)]
    pub meta: TensorMeta,
    /// Where the memory is: `cpu` takes a `shm` handle, `cuda:N` a
    /// `cuda_ipc` one. Every entry of a set is on the same device.
    pub device: Device,
    /// The memory lent.
    pub mem: MemHandle,
}

/// Name, dtype and shape of each tensor of a set, in order: what a getter
/// learns about a key, and checks its destination against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDesc {
    /// `""` for a single tensor; a state dict's parameter name otherwise.
    pub name: String,
    /// Dtype and shape, flattened: `dtype` and `shape` sit beside `name`.
    #[serde(flatten)]
    pub meta: TensorMeta,
}

/// Checks a set of entries: names unique and bounded, sizes consistent with
/// the handles, one device for all.
pub fn validate_entries(entries: &[TensorEntry]) -> Result<(), String> {
    if entries.is_empty() {
        return Err("no tensors".into());
    }
    if entries.len() > MAX_TENSORS {
        return Err(format!(
            "{} tensors, more than {MAX_TENSORS}",
            entries.len()
        ));
    }
    let mut names = std::collections::HashSet::new();
    for e in entries {
        if e.name.len() > MAX_NAME_LEN || e.name.chars().any(char::is_control) {
            return Err(format!(
                "tensor name {:?} is longer than {MAX_NAME_LEN} bytes or has control characters",
                e.name
            ));
        }
        if !names.insert(e.name.as_str()) {
            return Err(format!("tensor name {:?} appears twice", e.name));
        }
        let n = e
            .meta
            .nbytes()
            .map_err(|m| format!("tensor {:?}: {m}", e.name))?;
        if n != e.mem.len() {
            return Err(format!(
                "tensor {:?}: {} needs {n} bytes, its memory handle has {}",
                e.name,
                e.meta,
                e.mem.len()
            ));
        }
        let handle_fits = matches!(
            (&e.mem, e.device),
            (MemHandle::Shm { .. }, Device::Cpu) | (MemHandle::CudaIpc { .. }, Device::Cuda(_))
        );
        if !handle_fits {
            return Err(format!(
                "tensor {:?}: a {} tensor cannot be lent by a {} handle",
                e.name,
                e.device,
                match e.mem {
                    MemHandle::Shm { .. } => "shared-memory",
                    MemHandle::CudaIpc { .. } => "CUDA IPC",
                }
            ));
        }
        if e.device != entries[0].device {
            return Err(format!(
                "tensor {:?} is on {}, {:?} on {}: one set lives on one device",
                e.name, e.device, entries[0].name, entries[0].device
            ));
        }
    }
    Ok(())
}

/// Checks that a destination can receive a source: same names in the same
/// order, same dtype and shape each. The error names both sides.
pub fn check_destination(key: &Key, src: &[TensorDesc], dest: &[TensorDesc]) -> Result<(), String> {
    if src.len() != dest.len() {
        let names = |v: &[TensorDesc]| {
            let n: Vec<&str> = v.iter().take(4).map(|d| d.name.as_str()).collect();
            format!("{}{}", n.join(", "), if v.len() > 4 { ", ..." } else { "" })
        };
        return Err(format!(
            "key {key} holds {} tensors ({}), the destination has {} ({})",
            src.len(),
            names(src),
            dest.len(),
            names(dest)
        ));
    }
    for (s, d) in src.iter().zip(dest) {
        if s.name != d.name {
            return Err(format!(
                "key {key}: source tensor {:?} meets destination tensor {:?} at the same position (state dicts must list the same names in the same order)",
                s.name, d.name
            ));
        }
        if s.meta != d.meta {
            let what = if s.name.is_empty() {
                String::new()
            } else {
                format!(" tensor {:?}", s.name)
            };
            return Err(format!(
                "key {key}{what}: source is {}, destination is {}",
                s.meta, d.meta
            ));
        }
    }
    Ok(())
}

/// The name, dtype and shape of each entry, in order.
pub fn describe(entries: &[TensorEntry]) -> Vec<TensorDesc> {
    entries
        .iter()
        .map(|e| TensorDesc {
            name: e.name.clone(),
            meta: e.meta.clone(),
        })
        .collect()
}

/// The version id of a tensor set: its layout and the registration that lends it.
pub fn version_of(descs: &[TensorDesc], registration: &str) -> String {
    let mut h = fnv1a(registration.as_bytes(), 0);
    for d in descs {
        h = fnv1a(d.name.as_bytes(), h);
        h = fnv1a(d.meta.to_string().as_bytes(), h);
    }
    format!("t-{h:016x}")
}

/// FNV-1a (no hashing dependency here: the version is an id, not a checksum).
fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325_u64 ^ seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Summary of a tensor key, kept in its record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSummary {
    /// Tensors in the set.
    pub tensors: u64,
    /// The device the set lives on.
    pub device: Device,
    /// Distinct dtypes, sorted.
    pub dtypes: Vec<DType>,
}

/// How the agent moves tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// Shared memory plus TCP between agents (CPU tensors).
    Host,
    /// NCCL through dynamically loaded libraries (CUDA tensors).
    Nccl,
}

impl BackendKind {
    /// The backend that moves tensors on `d`: host for the CPU, NCCL for a
    /// GPU.
    pub fn for_device(d: Device) -> BackendKind {
        match d {
            Device::Cpu => BackendKind::Host,
            Device::Cuda(_) => BackendKind::Nccl,
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Host => "host",
            BackendKind::Nccl => "nccl",
        })
    }
}

/// Pack options of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Packing {
    /// Send all tensors of one dtype as one buffer (in buckets).
    pub pack: bool,
    /// Largest bucket (bytes); a tensor larger than a bucket goes alone.
    pub bucket_bytes: u64,
}

impl Default for Packing {
    fn default() -> Self {
        Packing {
            pack: false,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
        }
    }
}

impl Packing {
    /// Checks that a bucket is at least [`MIN_BUCKET_BYTES`] (whether
    /// packing is on or not).
    pub fn validate(&self) -> Result<(), String> {
        if self.bucket_bytes < MIN_BUCKET_BYTES {
            return Err(format!(
                "bucket of {} bytes is under the {MIN_BUCKET_BYTES}-byte minimum",
                self.bucket_bytes
            ));
        }
        Ok(())
    }
}

/// One flow of a plan: `root` sends `key`'s tensors to `receivers`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Flow {
    /// The key whose tensors move.
    pub key: Key,
    /// The version the root sends.
    pub version: String,
    /// The rank that sends.
    pub root: u32,
    /// The ranks that receive: at least one, never the root.
    pub receivers: Vec<u32>,
    /// The layout sent, in order: what the root lends and every receiver's
    /// destination matches.
    pub tensors: Vec<TensorDesc>,
}

impl Flow {
    /// Every member of the flow, root and receivers, sorted: the group of
    /// its broadcasts.
    pub fn group(&self) -> Vec<u32> {
        let mut group = self.receivers.clone();
        group.push(self.root);
        group.sort_unstable();
        group.dedup();
        group
    }
}

/// One member of a transfer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rank {
    /// Its rank: its index in [`TransferPlan::ranks`].
    pub rank: u32,
    /// The member's agent id (its pod's name).
    pub agent: String,
    /// The member's process within its pod ([`QuorumJoin::member`]); empty
    /// for a point-to-point session's ranks.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub member: String,
    /// The pod's IP (what `ips` in a window names).
    pub ip: String,
    /// Backend address of the member (host: its data listener `ip:port`).
    pub endpoint: String,
    /// The node the member's agent runs on ([`QuorumJoin::node`]); empty:
    /// not known (the rank is a host of its own to the plan).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,
}

impl Rank {
    /// `agent`, or `agent/member` for a member process: how communicators
    /// list their ranks ([`HeldComm::members`]) and errors name a member.
    pub fn label(&self) -> String {
        member_label(&self.agent, &self.member)
    }
}

/// `agent`, or `agent/member` when `member` is not empty.
pub fn member_label(agent: &str, member: &str) -> String {
    if member.is_empty() {
        agent.to_owned()
    } else {
        format!("{agent}/{member}")
    }
}

/// Longest node name ([`QuorumJoin::node`]): a Kubernetes node's name is
/// a DNS subdomain.
pub const MAX_NODE_NAME_LEN: usize = 253;

/// Why `n` is not a node name a quorum member may report
/// ([`QuorumJoin::node`]: a DNS-1123 subdomain, as Kubernetes names its
/// nodes: 1 to [`MAX_NODE_NAME_LEN`] lowercase ASCII letters, digits, `-`
/// and `.`, starting and ending with a letter or digit), if it is not.
pub fn node_name_problem(n: &str) -> Option<String> {
    let edge = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    let ok = !n.is_empty()
        && n.len() <= MAX_NODE_NAME_LEN
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.'))
        && edge(n.as_bytes().first())
        && edge(n.as_bytes().last());
    (!ok).then(|| {
        format!(
            "node name {n:?} must be 1 to {MAX_NODE_NAME_LEN} lowercase ASCII letters, digits, \
             '-' or '.', starting and ending with a letter or digit (a Kubernetes node's \
             spec.nodeName)"
        )
    })
}

/// The host identity of the ranks on `node`: ranks of one node share it,
/// and it is the `NCCL_HOSTID` an agent on that node gives NCCL under
/// `KT_NCCL_SAME_NODE=p2p`, so NCCL connects them over P2P/NVLink or SHM.
pub fn node_host_id(node: &str) -> String {
    format!("kt-node-{node}")
}

/// Longest member id ([`QuorumJoin::member`]).
pub const MAX_MEMBER_LEN: usize = 128;

/// Why `m` is not a valid member id (1 to [`MAX_MEMBER_LEN`] bytes of
/// ASCII letters, digits, `.`, `_`, `-`), if it is not.
pub fn member_id_problem(m: &str) -> Option<String> {
    let ok = !m.is_empty()
        && m.len() <= MAX_MEMBER_LEN
        && m.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    (!ok).then(|| {
        format!(
            "member id {m:?} must be 1 to {MAX_MEMBER_LEN} ASCII letters, digits, '.', '_' or '-'"
        )
    })
}

/// A reduction a quorum getter asks for over every putter's tensors of a
/// key ([`FromPutters::Reduce`]), computed by the getter's agent as the
/// tensors arrive, in putter-rank order (so the result is deterministic).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    /// Element-wise sum. Floats accumulate in `f64` (`f16`, `bf16` and
    /// `f32` too) and are rounded once at the end; integers wrap around in
    /// their own width, as PyTorch's integer sum does.
    Sum,
    /// The sum divided by the number of putters; floats only.
    Mean,
}

impl ReduceOp {
    /// The name on the wire (`sum`, `mean`).
    pub fn as_str(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
        }
    }

    /// Whether tensors of `dtype` can be reduced so, or why not.
    pub fn check(self, dtype: DType) -> Result<(), String> {
        match (self, dtype) {
            (_, DType::Bool) => Err(format!(
                "a {self} of bool tensors is not defined (their sum is not a bool);                  put them as u8 or an integer type to count, or ask for every putter's tensor"
            )),
            (_, DType::F8e4m3 | DType::F8e5m2) => Err(format!(
                "a {self} of {dtype} tensors is not supported (8-bit floats would round every                  partial sum); put them as f16, bf16 or f32, or ask for every putter's tensor"
            )),
            (ReduceOp::Mean, DType::I64 | DType::I32 | DType::I16 | DType::I8 | DType::U8) => {
                Err(format!(
                    "a mean of {dtype} tensors is not defined (it is not an integer; PyTorch                  refuses it too): ask for the sum and divide, or put floats"
                ))
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sum" => Ok(ReduceOp::Sum),
            "mean" => Ok(ReduceOp::Mean),
            other => Err(format!("unknown reduction {other:?} (sum, mean)")),
        }
    }
}

/// How a quorum getter receives a key that several putters put (each
/// putter's tensors are a flow of their own, rooted at its rank).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum FromPutters {
    /// One tensor set per putter, by putter rank ascending: `count` sets,
    /// exactly as many as the key has putters.
    All {
        /// Destination sets; the key's putters must be this many.
        count: u32,
    },
    /// The tensor sets of these putter ranks (plan ranks; ascending, each
    /// once, each a putter of the key).
    ByRank {
        /// The putters' ranks.
        ranks: Vec<u32>,
    },
    /// One tensor set: every putter's, reduced on receive.
    Reduce {
        /// The reduction.
        op: ReduceOp,
    },
}

impl FromPutters {
    /// Destination sets this asks for.
    pub fn sets(&self) -> usize {
        match self {
            FromPutters::All { count } => *count as usize,
            FromPutters::ByRank { ranks } => ranks.len(),
            FromPutters::Reduce { .. } => 1,
        }
    }

    /// Checks it against the getter's destination layout: counts within
    /// bounds, ranks ascending and distinct, a reduction defined for every
    /// dtype.
    pub fn check(&self, key: &Key, layout: &[TensorDesc]) -> Result<(), String> {
        match self {
            FromPutters::All { count } => {
                if *count == 0 || *count as usize > MAX_PUTTERS {
                    return Err(format!(
                        "{key}: asks for {count} putters' tensors (1 to {MAX_PUTTERS})"
                    ));
                }
            }
            FromPutters::ByRank { ranks } => {
                if ranks.is_empty() || ranks.len() > MAX_PUTTERS {
                    return Err(format!(
                        "{key}: asks for {} ranks' tensors (1 to {MAX_PUTTERS})",
                        ranks.len()
                    ));
                }
                if ranks.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(format!(
                        "{key}: the ranks asked for must be ascending and distinct, got {ranks:?}"
                    ));
                }
            }
            FromPutters::Reduce { op } => {
                for d in layout {
                    op.check(d.meta.dtype).map_err(|m| {
                        if d.name.is_empty() {
                            format!("{key}: {m}")
                        } else {
                            format!("{key} tensor {:?}: {m}", d.name)
                        }
                    })?;
                }
            }
        }
        Ok(())
    }
}

/// Most putters whose tensors one getter asks for, each into its own set.
pub const MAX_PUTTERS: usize = 4096;

/// Where a getter's tensors of one flow came from
/// ([`TensorStats::sources`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSource {
    /// The key received.
    pub key: Key,
    /// The putter's rank in the plan.
    pub rank: u32,
    /// The putter's agent (its pod).
    pub agent: String,
    /// The putter's process within its pod ([`Rank::member`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub member: String,
}

/// A coordinated transfer: who takes part, and what moves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferPlan {
    /// Unique id of this transfer (NCCL communicators and host connections
    /// are bound to it).
    pub id: String,
    /// The backend every rank runs.
    pub backend: BackendKind,
    /// Every member, the one of rank `i` at index `i`; two or more.
    pub ranks: Vec<Rank>,
    /// What moves; every rank runs the flows it is part of, in this order.
    pub flows: Vec<Flow>,
    /// Whether and how the tensors of every flow are packed.
    pub packing: Packing,
    /// Children per node of a host-backend tree.
    pub fanout: u32,
}

impl TransferPlan {
    /// The node of rank `r` (empty: not known, or no such rank).
    pub fn node_of(&self, r: u32) -> &str {
        self.ranks.get(r as usize).map_or("", |x| x.node.as_str())
    }

    /// Whether ranks `a` and `b` are known to run on one node (a rank of
    /// unknown node shares it with no other).
    pub fn same_node(&self, a: u32, b: u32) -> bool {
        let n = self.node_of(a);
        !n.is_empty() && n == self.node_of(b)
    }

    /// The plan's ranks grouped by node: each known node with its ranks,
    /// ascending, nodes in the order of their lowest rank. Ranks of
    /// unknown node are left out. Members of one node are one host to the
    /// transport ([`node_host_id`]): the host backend's trees cross each
    /// node's boundary once, NCCL (`KT_NCCL_SAME_NODE=p2p`) connects them
    /// over P2P/NVLink or SHM.
    pub fn nodes(&self) -> Vec<(&str, Vec<u32>)> {
        let mut out: Vec<(&str, Vec<u32>)> = Vec::new();
        for r in &self.ranks {
            if r.node.is_empty() {
                continue;
            }
            match out.iter_mut().find(|(n, _)| *n == r.node) {
                Some((_, ranks)) => ranks.push(r.rank),
                None => out.push((r.node.as_str(), vec![r.rank])),
            }
        }
        out
    }

    /// Checks the plan's shape: ranks numbered 0..n, flows naming ranks that
    /// exist, a root that does not receive its own flow.
    pub fn validate(&self) -> Result<(), String> {
        let n = self.ranks.len() as u32;
        if n < 2 {
            return Err(format!("a transfer needs two ranks or more, got {n}"));
        }
        for (i, r) in self.ranks.iter().enumerate() {
            if r.rank != i as u32 {
                return Err(format!("rank {} listed at position {i}", r.rank));
            }
        }
        self.packing.validate()?;
        for f in &self.flows {
            if f.root >= n || f.receivers.iter().any(|r| *r >= n || *r == f.root) {
                return Err(format!("flow of {} names ranks outside 0..{n}", f.key));
            }
            if f.receivers.is_empty() {
                return Err(format!("flow of {} has no receivers", f.key));
            }
        }
        Ok(())
    }
}

/// Counters of one tensor transfer, as the agent reports them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TensorStats {
    /// Tensors moved (sent, for a root).
    pub tensors: u64,
    /// Bytes of those tensors.
    pub bytes: u64,
    /// Collectives run (one per tensor unpacked, one per bucket packed).
    pub collectives: u64,
    /// Wall-clock seconds of the transfer (summed over the transfers of a
    /// get from several sources).
    pub seconds: f64,
    /// The backend that moved them; `null` in an empty report (a failed
    /// rank's `done`).
    pub backend: Option<BackendKind>,
    /// Rank and world size when the transfer was a quorum's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    /// See `rank`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world: Option<u32>,
    /// The transfer ran on a communicator kept from an earlier transfer of
    /// the same ranks ([`QuorumPlan::reuse`]): nothing was connected.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reused: bool,
    /// A quorum getter's: the putter of each flow it received, in the
    /// order received (by key, then putter rank). Empty for a putter and
    /// for point-to-point gets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<TensorSource>,
    /// A quorum rank's place among its plan's nodes; absent when no rank
    /// of the plan reported its node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
}

/// Where a quorum's plan put a rank among the nodes of its members
/// ([`TransferPlan::nodes`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The rank's host identity ([`node_host_id`] of its node); empty when
    /// its node is not known (a host of its own).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub host: String,
    /// The other ranks of the plan on its node, ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub same_node: Vec<u32>,
    /// Host backend: the peers of the rank's trees (its parent and
    /// children over every flow it takes part in, each peer once) on its
    /// node. NCCL plans its own rings and trees (0 here).
    #[serde(default)]
    pub links_same_node: u32,
    /// Host backend: those peers on other nodes (or of unknown node).
    #[serde(default)]
    pub links_other_nodes: u32,
}

// ---- the control socket (version 2) --------------------------------------

/// `put_tensor` / `put_state_dict`: register `tensors` under `key`. Without
/// a broadcast the key is published at once (getters fetch peer to peer
/// while the owning process lives); with one, the agent joins the quorum
/// and the request is answered when the transfer is over.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PutTensors {
    /// The key to publish the tensors under.
    pub key: Key,
    /// The tensors lent, in order: one named `""`, or a state dict
    /// (checked by [`validate_entries`]).
    pub tensors: Vec<TensorEntry>,
    /// The key's lifecycle; the defaults of [`PutOptions`] when absent.
    #[serde(default)]
    pub options: PutOptions,
    /// Join this quorum as a putter; absent: publish for point-to-point
    /// gets only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broadcast: Option<BroadcastWindow>,
    /// A label that tells this caller's quorum membership apart from other
    /// ones of the same process ([`QuorumJoin::member`]): for a process
    /// that drives several GPUs from threads, each its own rank. Absent:
    /// the process is one member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub member: Option<String>,
}

/// `get_tensor` / `get_state_dict` into lent destination memory. Several
/// keys from one source are fetched in one transfer. The destination's
/// tensors must match the source's by name, order, dtype and shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GetTensors {
    /// One per key: at least one, no key twice, every destination on the
    /// same device.
    pub gets: Vec<TensorGet>,
    /// Receive by joining this quorum as a getter (a get of several keys
    /// must name its group); absent: point to point from each key's holder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broadcast: Option<BroadcastWindow>,
    /// Point to point: pack options (default: packed, in buckets of
    /// [`DEFAULT_BUCKET_BYTES`]). A broadcast takes them from its window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packing: Option<Packing>,
    /// CUDA destinations: keep what the agent opened of them (their IPC
    /// mappings) after the get, for a caller that gets into the same
    /// memory again (a training loop's weights); they are closed when the
    /// calling process goes away. By default they are closed when the get
    /// ends, so memory the caller frees is not pinned by the agent.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_mapped: bool,
    /// See [`PutTensors::member`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub member: Option<String>,
}

/// One key of a [`GetTensors`] and the memory it goes into.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorGet {
    /// The key to receive.
    pub key: Key,
    /// The destination tensors lent, matching the key's tensors by name,
    /// order, dtype and shape ([`check_destination`]); with `from`, the
    /// first destination set.
    pub dest: Vec<TensorEntry>,
    /// A quorum get of a key several putters put: every putter's tensors
    /// (`all`: `dest` then `more`, by putter rank; `by_rank`: `dest` for
    /// the first rank listed, `more` for the others in order) or their
    /// reduction (`reduce`: into `dest`, `more` empty). Absent: the key has
    /// one putter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<FromPutters>,
    /// The destination sets after `dest` (see `from`), each of `dest`'s
    /// layout.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub more: Vec<Vec<TensorEntry>>,
}

/// A registration as the agent's status lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRegistration {
    /// The key registered.
    pub key: Key,
    /// The version it was published as.
    pub version: String,
    /// The owning process (0 when its pid is not visible to the agent; the
    /// registration then lives as long as its control connection).
    pub pid: u32,
    /// Tensors in the set.
    pub tensors: u64,
    /// Bytes lent, summed over the set.
    pub bytes: u64,
    /// The device the set lives on.
    pub device: Device,
}

// ---- agent to agent: point to point ---------------------------------------

/// `POST /api/v1/tensors/sessions` on the source's agent: open a transfer
/// of these keys to the caller (rank 1; the source is rank 0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionRequest {
    /// The keys, each with the layout of the getter's destination (checked
    /// by the source before anything moves) and the version it saw.
    pub keys: Vec<QuorumKey>,
    /// The getter's agent id.
    pub agent: String,
    /// The getter's pod IP.
    pub ip: String,
    /// The getter's backend endpoint (rank 1's [`Rank::endpoint`]).
    pub endpoint: String,
    /// The getter's backend; the source refuses one that is not its own.
    pub backend: BackendKind,
    /// Pack options of the transfer; [`Packing::default`] (unpacked) when
    /// absent.
    #[serde(default)]
    pub packing: Packing,
    /// Communicators the getter keeps from earlier sessions with this
    /// source (NCCL), reserved for this one: the source answers one it
    /// keeps too ([`SessionReply::reuse`]). At most [`MAX_HELD_COMMS`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub comms: Vec<HeldComm>,
    /// One capability per key, in the order of `keys`
    /// ([`TensorGrant::capability`]): what the getter's agent shows the
    /// source instead of its bearer token (which then carries the first of
    /// them). Empty when the caller presents a bearer token.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
}

/// `POST /api/v1/tensors/grants/{key}` on the metadata server: a getter's
/// agent asks where a key's tensors are and for what it shows their holder
/// (a capability, never its token). The caller's token must read the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorGrantRequest {
    /// The getter's agent id: the caller's own agent (403 otherwise).
    pub getter: String,
}

/// The answer to a [`TensorGrantRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorGrant {
    /// The key's record (its holder, source URL and version).
    pub record: crate::KeyRecord,
    /// A capability for the record's version at its holder, minted for the
    /// getter (`kt_service::capability`; [`crate::auth::Capability`]);
    /// absent when the getter's agent holds the key itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capability: Option<String>,
}

/// The answer: the plan both sides run, and (NCCL) the communicator's id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionReply {
    /// Two ranks (the source 0, the getter 1), one flow per key.
    pub plan: TransferPlan,
    /// The backend's bootstrap blob (NCCL's unique id, hex); absent for the
    /// host backend and when a kept communicator is reused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rendezvous: Option<String>,
    /// The id of a communicator both sides keep (one the getter listed):
    /// the session runs on it, with no rendezvous.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reuse: Option<String>,
}

// ---- the metadata server's quorum -----------------------------------------

/// What a member brings to a quorum, tagged by `role` (`put` or `get`)
/// and flattened into [`QuorumJoin`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum QuorumRole {
    /// Publishes these keys' tensors (already registered at its agent).
    Put {
        /// 1 to 4096 keys, none twice, each with its version and layout;
        /// another putter of the round may put one of them too, with the
        /// same layout.
        keys: Vec<QuorumKey>,
    },
    /// Wants these keys, into destinations of this layout.
    Get {
        /// 1 to 4096 keys, none twice, each with its destination's layout.
        keys: Vec<QuorumKey>,
    },
}

/// One key a quorum member or point-to-point getter names, with a layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuorumKey {
    /// The key.
    pub key: Key,
    /// A putter's: the version of its registration. A point-to-point
    /// getter's: the version it saw in the key's record (the source refuses
    /// another). Empty (omitted): any version, as quorum getters send it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub version: String,
    /// A putter's: the tensors it sends. A getter's: its destination's
    /// layout, checked against the source's.
    pub tensors: Vec<TensorDesc>,
    /// A quorum getter's: how it receives a key several putters put (see
    /// [`FromPutters`]). Absent: from the key's one putter (a key with
    /// several putters is then refused, naming these options).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<FromPutters>,
}

/// `POST /api/v1/quorums/{group}/join`: answered when the quorum closes (on
/// world size, on every listed ip, or on the window's timeout, whichever
/// first) with this member's place in the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuorumJoin {
    /// The joining agent's id (its pod).
    pub agent: String,
    /// The process this member is within its pod (the agent names it: the
    /// client's pid, with its label when it gave one): each process of a
    /// pod takes a rank of its own, and one member joins a round once.
    /// Empty: the agent's only member (older agents).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub member: String,
    /// The agent's pod IP (what the window's `ips` name).
    pub ip: String,
    /// The agent's backend endpoint (its [`Rank::endpoint`] in the plan).
    pub endpoint: String,
    /// The node the agent's pod runs on (`KT_NODE_NAME`, the downward
    /// API's `spec.nodeName`; [`node_name_problem`] says what is valid):
    /// the plan groups members by node ([`TransferPlan::nodes`]). Empty:
    /// not known (older agents, or a pod without it).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,
    /// The member's backend; the round's first join fixes it, and a
    /// member on another one is refused.
    pub backend: BackendKind,
    /// Putter or getter, flattened: `role` and `keys` sit at the top level
    /// of the object. Several putters may put one key (each a flow of its
    /// own), all with the same layout.
    #[serde(flatten)]
    pub role: QuorumRole,
    /// The window. The round's first join fixes its settings; later joins'
    /// windows are checked, then ignored.
    pub window: BroadcastWindow,
    /// Communicators this agent keeps idle from earlier transfers of this
    /// group (NCCL), reserved for this join: when every member of the
    /// closing round holds one of the same members in the same ranks, the
    /// plan reuses it ([`QuorumPlan::reuse`]) instead of building a new
    /// one. At most [`MAX_HELD_COMMS`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub comms: Vec<HeldComm>,
}

/// Most communicators a join may list ([`QuorumJoin::comms`]).
pub const MAX_HELD_COMMS: usize = 8;

/// A communicator an agent keeps from an earlier transfer
/// ([`QuorumJoin::comms`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldComm {
    /// The id of the transfer that built it (every rank of that transfer
    /// keeps it under this id).
    pub id: String,
    /// Its ranks' [`Rank::label`]s (`agent` or `agent/member`), rank 0
    /// first.
    pub members: Vec<String>,
}

impl HeldComm {
    /// Whether `plan`'s ranks are exactly this communicator's, in order.
    pub fn fits(&self, plan: &TransferPlan) -> bool {
        self.members.len() == plan.ranks.len()
            && self
                .members
                .iter()
                .zip(&plan.ranks)
                .all(|(m, r)| *m == r.label())
    }
}

/// The answer to a quorum join once its round closed: this member's place
/// in the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuorumPlan {
    /// The group joined.
    pub group: String,
    /// This member's rank in [`QuorumPlan::plan`].
    pub rank: u32,
    /// Shared: a round answers every member the same plan.
    pub plan: Arc<TransferPlan>,
    /// Why the quorum closed: `world_size`, `ips` or `timeout`.
    pub closed_by: String,
    /// The id of a communicator every rank listed in its join
    /// ([`QuorumJoin::comms`]) and whose ranks are the plan's: the ranks
    /// run on it, with no rendezvous. Absent: they build one (and keep it
    /// under the plan's id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reuse: Option<String>,
}

/// `PUT /api/v1/quorums/{group}/{transfer}/rendezvous` (rank 0) and `GET`
/// (the others, long-polled): the backend's bootstrap blob (NCCL's unique id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rendezvous {
    /// The blob, 1 to 64 KiB (NCCL's unique id, hex). Published once: the
    /// same blob again is accepted, another one is a `conflict`.
    pub blob: String,
}

/// `POST /api/v1/quorums/{group}/{transfer}/done`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuorumDone {
    /// The reporting rank; each rank reports once.
    pub rank: u32,
    /// Why this rank failed; absent: it succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What this rank moved; zeros when absent.
    #[serde(default)]
    pub stats: TensorStats,
}

/// `GET /api/v1/quorums/{group}/{transfer}?wait_ms=N` (long-polled until
/// every rank reported, or N ms), and the answer to `done`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuorumStatus {
    /// The group.
    pub group: String,
    /// The transfer's id ([`TransferPlan::id`]).
    pub transfer: String,
    /// Ranks in the plan.
    pub world: u32,
    /// Ranks that reported success.
    pub done: Vec<u32>,
    /// Ranks that reported failure, with their error.
    pub failed: Vec<(u32, String)>,
    /// True once every rank reported.
    pub complete: bool,
}

/// `GET /api/v1/quorums/{group}`: the group's open round and kept transfers
/// (for operators and tests).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuorumInfo {
    /// The group.
    pub group: String,
    /// The round open for joins; absent when none is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open: Option<QuorumRound>,
    /// Transfers of the group's closed rounds still kept, oldest first.
    #[serde(default)]
    pub transfers: Vec<QuorumStatus>,
}

/// A round still open for joins.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuorumRound {
    /// The members' labels (`agent`, or `agent/member` for a member
    /// process), in join order.
    pub members: Vec<String>,
    /// The round's backend (from its first join).
    pub backend: BackendKind,
    /// The member count that closes it (from its first join's window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
    /// The IPs whose joins close it (from its first join's window).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ips: Vec<String>,
    /// Milliseconds until the round closes by timeout.
    pub closes_in_ms: u64,
}

/// What a put of tensors answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorsPut {
    /// The key published.
    pub key: Key,
    /// The version the registration got ([`version_of`]).
    pub version: String,
    /// The key's record at the metadata server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<Box<KeyRecord>>,
    /// Set when the put took part in a broadcast.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats: Option<TensorStats>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, dtype: DType, shape: &[u64]) -> TensorEntry {
        let meta = TensorMeta::new(dtype, shape);
        let len = meta.nbytes().unwrap();
        TensorEntry {
            name: name.into(),
            meta,
            device: Device::Cpu,
            mem: MemHandle::Shm {
                path: "/dev/shm/x".into(),
                offset: 0,
                len,
            },
        }
    }

    #[test]
    fn dtypes_parse_ours_and_torch_names() {
        for d in DType::ALL {
            assert_eq!(d.as_str().parse::<DType>().unwrap(), d);
        }
        assert_eq!("torch.bfloat16".parse::<DType>().unwrap(), DType::Bf16);
        assert_eq!("float".parse::<DType>().unwrap(), DType::F32);
        assert!("complex64".parse::<DType>().is_err());
        let j = serde_json::to_string(&DType::Bf16).unwrap();
        assert_eq!(j, r#""bf16""#);
    }

    #[test]
    fn devices_round_trip() {
        for s in ["cpu", "cuda:0", "cuda:7"] {
            let d: Device = s.parse().unwrap();
            assert_eq!(d.to_string(), s);
        }
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert!("tpu".parse::<Device>().is_err());
    }

    #[test]
    fn sizes_are_checked() {
        assert_eq!(
            TensorMeta::new(DType::F32, [1000, 1000]).nbytes(),
            Ok(4_000_000)
        );
        assert_eq!(TensorMeta::new(DType::F16, []).nbytes(), Ok(2));
        assert!(TensorMeta::new(DType::F64, [u64::MAX, 2]).nbytes().is_err());
        assert!(TensorMeta::new(DType::U8, vec![1; 17]).nbytes().is_err());
    }

    #[test]
    fn entries_are_validated() {
        let ok = vec![
            entry("a", DType::F32, &[4]),
            entry("b", DType::I64, &[2, 2]),
        ];
        validate_entries(&ok).unwrap();
        let mut dup = ok.clone();
        dup[1].name = "a".into();
        assert!(validate_entries(&dup).unwrap_err().contains("twice"));
        let mut short = ok.clone();
        if let MemHandle::Shm { len, .. } = &mut short[0].mem {
            *len = 3;
        }
        let e = validate_entries(&short).unwrap_err();
        assert!(e.contains("needs 16 bytes") && e.contains("has 3"), "{e}");
        let mut mixed = ok.clone();
        mixed[1].device = Device::Cuda(0);
        let e = validate_entries(&mixed).unwrap_err();
        assert!(e.contains("cuda:0") && e.contains("shared-memory"), "{e}");
        assert!(validate_entries(&[]).is_err());
    }

    #[test]
    fn destination_mismatch_names_both_sides() {
        let key = Key::parse("m/w").unwrap();
        let src = describe(&[entry("w", DType::F32, &[10, 10])]);
        let bad = describe(&[entry("w", DType::F32, &[10, 11])]);
        let e = check_destination(&key, &src, &bad).unwrap_err();
        assert!(
            e.contains("f32[10, 10]") && e.contains("f32[10, 11]"),
            "{e}"
        );
        let other = describe(&[entry("w", DType::F16, &[10, 10])]);
        let e = check_destination(&key, &src, &other).unwrap_err();
        assert!(e.contains("f16[10, 10]"), "{e}");
        let two = describe(&[
            entry("w", DType::F32, &[10, 10]),
            entry("b", DType::F32, &[1]),
        ]);
        let e = check_destination(&key, &src, &two).unwrap_err();
        assert!(e.contains("1 tensors") && e.contains("has 2"), "{e}");
        check_destination(&key, &src, &src).unwrap();
    }

    #[test]
    fn node_names_are_kubernetes_node_names() {
        let (longest, too_long) = ("n".repeat(253), "n".repeat(254));
        for ok in [
            "node-a",
            "gpu-node-3",
            "ip-10-0-1-7.ec2.internal",
            "a",
            longest.as_str(),
        ] {
            assert_eq!(node_name_problem(ok), None, "{ok}");
        }
        for bad in [
            "",
            "Node-a",
            "-a",
            "a-",
            ".a",
            "a_b",
            "a b",
            "a/b",
            "nœud",
            too_long.as_str(),
        ] {
            let why = node_name_problem(bad).expect(bad);
            assert!(why.contains("node name") && why.contains("253"), "{why}");
        }
        assert_eq!(node_host_id("gpu-node-3"), "kt-node-gpu-node-3");
    }

    /// The pure part of planning pods that share a node: members on two
    /// nodes, two pods each (and one of unknown node).
    #[test]
    fn plans_group_their_ranks_by_node() {
        let rank = |r: u32, node: &str| Rank {
            rank: r,
            agent: format!("pod-{r}"),
            member: String::new(),
            node: node.into(),
            ip: "10.0.0.1".into(),
            endpoint: "10.0.0.1:1".into(),
        };
        let plan = TransferPlan {
            id: "t".into(),
            backend: BackendKind::Host,
            ranks: vec![
                rank(0, "node-a"),
                rank(1, "node-b"),
                rank(2, "node-a"),
                rank(3, ""),
                rank(4, "node-b"),
            ],
            flows: vec![],
            packing: Packing::default(),
            fanout: 2,
        };
        assert_eq!(
            plan.nodes(),
            [("node-a", vec![0, 2]), ("node-b", vec![1, 4])]
        );
        assert!(plan.same_node(0, 2) && plan.same_node(4, 1));
        assert!(!plan.same_node(0, 1) && !plan.same_node(3, 3) && !plan.same_node(0, 9));
        assert_eq!(
            (plan.node_of(4), plan.node_of(3), plan.node_of(9)),
            ("node-b", "", "")
        );
        // A rank without a node says nothing of it on the wire.
        let json = serde_json::to_value(&plan.ranks[3]).unwrap();
        assert!(json.get("node").is_none(), "{json}");
        let back: Rank = serde_json::from_value(json).unwrap();
        assert_eq!(back, plan.ranks[3]);
    }

    #[test]
    fn plans_are_validated() {
        let rank = |r: u32| Rank {
            rank: r,
            agent: format!("a{r}"),
            member: String::new(),
            node: String::new(),
            ip: "10.0.0.1".into(),
            endpoint: "10.0.0.1:1".into(),
        };
        let mut plan = TransferPlan {
            id: "t".into(),
            backend: BackendKind::Host,
            ranks: vec![rank(0), rank(1)],
            flows: vec![Flow {
                key: Key::parse("k").unwrap(),
                version: "v".into(),
                root: 0,
                receivers: vec![1],
                tensors: vec![],
            }],
            packing: Packing::default(),
            fanout: 2,
        };
        plan.validate().unwrap();
        plan.flows[0].receivers = vec![0];
        assert!(plan.validate().is_err());
        plan.flows[0].receivers = vec![2];
        assert!(plan.validate().is_err());
    }
}
