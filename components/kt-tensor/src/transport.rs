//! The transport trait: what a backend must provide for the engine to run a
//! transfer plan.

use std::time::Duration;

use kt_types::tensor::{BackendKind, Device, MemHandle, TransferPlan};

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The memory handle or the plan is not usable (the caller's fault).
    #[error("{0}")]
    Invalid(String),
    /// This machine cannot run the backend (no CUDA driver, no NCCL).
    #[error("{0}")]
    Unsupported(String),
    /// A peer did not answer in time.
    #[error("{0}")]
    Timeout(String),
    /// A peer went away, or the transfer broke.
    #[error("{0}")]
    Peer(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl TransportError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        TransportError::Io {
            context: context.into(),
            source,
        }
    }
}

/// A piece of memory a collective can read or write: lent by an application
/// (mapped from its handle) or a staging buffer of the backend.
pub trait Region: Send + Sync + std::fmt::Debug {
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn device(&self) -> Device;
    /// Host memory: the bytes. `None` for device memory.
    fn host(&self) -> Option<&[u8]>;
    fn host_mut(&mut self) -> Option<&mut [u8]>;
    /// Device memory: the device pointer (CUdeviceptr). `None` for host memory.
    fn device_ptr(&self) -> Option<u64>;
    /// Memory mapped from a shared-memory file: the file, and where the
    /// region starts in it (copies go through it, see [`crate::shm`]).
    fn shm_file(&self) -> Option<(&std::fs::File, u64)> {
        None
    }
}

/// The ranks of one transfer, connected. One collective at a time, in the
/// same order on every rank.
pub trait Comm: Send {
    fn rank(&self) -> u32;
    fn world(&self) -> u32;
    /// Broadcasts `len` bytes at `offset` of the root's `buf` into the same
    /// place of every other member of `group` (sorted ranks, holding `root`
    /// and this rank). Returns when this rank's part is over: the root's and
    /// every inner node's when all below it have received.
    fn broadcast(
        &mut self,
        root: u32,
        group: &[u32],
        buf: &mut dyn Region,
        offset: u64,
        len: u64,
    ) -> Result<(), TransportError>;

    /// Called by every member of a flow (root and receivers, the same
    /// `group` as its broadcasts) before its first broadcast: returns once
    /// every member is in the flow, waiting for those still busy with
    /// earlier flows of the plan. Nothing to do by default.
    fn begin_flow(&mut self, root: u32, group: &[u32]) -> Result<(), TransportError> {
        let _ = (root, group);
        Ok(())
    }

    /// Whether [`Comm::broadcast_parts`] gathers and scatters (no staging
    /// buffer needed to pack).
    fn gathers(&self) -> bool {
        false
    }

    /// Broadcasts whole `parts`, end to end, as one collective: a packed
    /// bucket without a staging copy. Only where [`Comm::gathers`].
    fn broadcast_parts(
        &mut self,
        root: u32,
        group: &[u32],
        parts: &mut [&mut dyn Region],
    ) -> Result<(), TransportError> {
        let _ = (root, group, parts);
        Err(TransportError::Unsupported(
            "this transport packs through staging buffers".into(),
        ))
    }
}

/// What a rank brings to a transfer before it knows the plan: the address
/// other ranks reach it at (host: a bound listener), kept until `connect`.
pub trait Endpoint: Send + std::fmt::Debug {
    /// Announced to the other ranks (in the plan's [`kt_types::tensor::Rank`]).
    fn address(&self) -> String;
    /// For the backend that made it, to take its own type back in `connect`.
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
}

/// A transport.
pub trait Backend: Send + Sync + std::fmt::Debug {
    fn kind(&self) -> BackendKind;

    /// Maps memory an application lent (cached by the backend where opening
    /// is expensive, as CUDA IPC handles are). `device` is where the entry
    /// says the memory lives.
    fn map(&self, handle: &MemHandle, device: Device) -> Result<Box<dyn Region>, TransportError>;

    /// Forgets what [`Backend::map`] keeps open for `handle` (CUDA: the
    /// IPC mapping, so the owner's memory is no longer pinned here):
    /// called when the memory's owner dropped it or went away. Regions
    /// still mapped stay valid. Nothing to do by default.
    fn release(&self, handle: &MemHandle) {
        let _ = handle;
    }

    /// A staging buffer of `len` bytes on `device` (pack buckets).
    fn alloc(&self, device: Device, len: u64) -> Result<Box<dyn Region>, TransportError>;

    /// Copies `len` bytes from `src` at `src_off` into `dst` at `dst_off`
    /// (both of this backend). Complete when it returns.
    fn copy(
        &self,
        dst: &mut dyn Region,
        dst_off: u64,
        src: &dyn Region,
        src_off: u64,
        len: u64,
    ) -> Result<(), TransportError>;

    /// Opens this rank's endpoint for transfer `id` on the pod's address `ip`.
    fn endpoint(&self, id: &str, ip: &str) -> Result<Box<dyn Endpoint>, TransportError>;

    /// Rank 0 of a transfer calls this before the others connect: a blob
    /// handed to every rank (NCCL's unique id). `None` when not needed.
    fn rendezvous(&self, plan: &TransferPlan) -> Result<Option<String>, TransportError>;

    /// Connects this rank to the others of `plan`. Every rank calls it, with
    /// rank 0's rendezvous blob; `device` is where this rank's memory of the
    /// transfer lives (as [`Region::device`] of its mapped regions says: the
    /// GPU a communicator binds to); `timeout` bounds the connection and every
    /// collective after it.
    fn connect(
        &self,
        plan: &TransferPlan,
        rank: u32,
        endpoint: Box<dyn Endpoint>,
        rendezvous: Option<&str>,
        device: Device,
        timeout: Duration,
    ) -> Result<Box<dyn Comm>, TransportError>;
}

/// The tree of a broadcast within `group` rooted at `root` with `fanout`
/// children per node: this rank's parent and children (ranks).
pub fn tree(root: u32, group: &[u32], me: u32, fanout: u32) -> (Option<u32>, Vec<u32>) {
    let fanout = fanout.max(1) as usize;
    let mut order = Vec::with_capacity(group.len());
    order.push(root);
    order.extend(group.iter().copied().filter(|r| *r != root));
    let Some(pos) = order.iter().position(|r| *r == me) else {
        return (None, Vec::new());
    };
    let parent = (pos > 0).then(|| order[(pos - 1) / fanout]);
    let first = pos * fanout + 1;
    let children = order.iter().skip(first).take(fanout).copied().collect();
    (parent, children)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trees_cover_the_group_once() {
        let group: Vec<u32> = (0..12).collect();
        for fanout in [1, 2, 3, 50] {
            let mut seen = vec![0; 12];
            for me in 0..12 {
                let (parent, children) = tree(5, &group, me, fanout);
                assert_eq!(parent.is_none(), me == 5);
                assert!(children.len() <= fanout as usize);
                for c in children {
                    seen[c as usize] += 1;
                    assert_eq!(tree(5, &group, c, fanout).0, Some(me));
                }
            }
            seen[5] += 1;
            assert!(seen.iter().all(|n| *n == 1), "fanout {fanout}: {seen:?}");
        }
        assert_eq!(tree(0, &[0, 3], 7, 2), (None, vec![]));
    }
}
