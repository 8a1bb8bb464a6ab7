//! The transport trait: what a backend must provide for the engine to run a
//! transfer plan.

use std::time::{Duration, Instant};

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

    /// Whether the communicator may still be running on the device after
    /// a failure (an abort that did not return): its memory must then not
    /// be freed. False by default.
    fn wedged(&self) -> bool {
        false
    }

    /// A [`Comm::wedged`] communicator takes what its kernels may still
    /// touch (the transfer's lent memory, its device hold) and drops it
    /// once they have stopped (NCCL: when the abort returns, see
    /// [`crate::hold::Reaper`]). By default it is kept for good.
    fn keep_until_stopped(&mut self, what: Box<dyn Send>) {
        std::mem::forget(what);
    }

    /// Whether this communicator can run another transfer of the same
    /// ranks (nothing failed or was aborted): kept for it rather than
    /// dropped. False by default (connected per transfer).
    fn reusable(&self) -> bool {
        false
    }

    /// Names the transfer this communicator now runs, in its errors.
    fn rename(&mut self, transfer: &str) {
        let _ = transfer;
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

    /// Holds `device` for one whole transfer, from before `connect` until
    /// its communicator and memory are dropped ([`crate::engine::transfer`]):
    /// for transports whose device-synchronising work must wait until no
    /// transfer runs ([`crate::hold`]). `None`: nothing to hold (the
    /// default). Waits at most `wait` for the device's frees to end, then
    /// fails saying what is stuck.
    fn hold(
        &self,
        device: Device,
        wait: Duration,
    ) -> Result<Option<Box<dyn Send>>, TransportError> {
        let _ = (device, wait);
        Ok(None)
    }

    /// Lets go of a communicator kept between transfers (replaced, evicted
    /// or not used after all), whose memory is on `device`: closed now, or
    /// (CUDA) once no transfer runs on the device, as every free there is
    /// ([`crate::hold`]). Call it from a blocking thread: closing waits for
    /// the library. Dropped at once by default.
    fn retire(&self, device: Device, comm: Box<dyn Comm>) {
        let _ = device;
        drop(comm);
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

    /// Reads `out.len()` bytes of `src` at `off` into host memory (a
    /// reduction on receive reads what arrived). By default through
    /// [`Region::host`]; a device backend copies from the device.
    fn read(&self, src: &dyn Region, off: u64, out: &mut [u8]) -> Result<(), TransportError> {
        let bytes = src.host().ok_or_else(|| {
            TransportError::Unsupported(format!(
                "the {} backend cannot read memory on {}",
                self.kind(),
                src.device()
            ))
        })?;
        let at = host_range(bytes.len(), off, out.len())?;
        out.copy_from_slice(&bytes[at]);
        Ok(())
    }

    /// Writes `bytes` into `dst` at `off` (a reduction's result). By
    /// default through [`Region::host_mut`]; a device backend copies to
    /// the device.
    fn write(&self, dst: &mut dyn Region, off: u64, bytes: &[u8]) -> Result<(), TransportError> {
        let device = dst.device();
        let out = dst.host_mut().ok_or_else(|| {
            TransportError::Unsupported(format!(
                "the {} backend cannot write memory on {device}",
                self.kind()
            ))
        })?;
        let at = host_range(out.len(), off, bytes.len())?;
        out[at].copy_from_slice(bytes);
        Ok(())
    }

    /// Opens this rank's endpoint for transfer `id` on the pod's address `ip`.
    fn endpoint(&self, id: &str, ip: &str) -> Result<Box<dyn Endpoint>, TransportError>;

    /// Rank 0 of a transfer calls this before the others connect: a blob
    /// handed to every rank (NCCL's unique id). `None` when not needed.
    fn rendezvous(&self, plan: &TransferPlan) -> Result<Option<String>, TransportError>;

    /// Rank 0 will not connect with `blob` after all (its transfer failed
    /// before): what the rendezvous keeps for it can go (NCCL: the unique
    /// id's helper process). `connect` of rank 0 does this itself.
    fn abandon_rendezvous(&self, blob: &str) {
        let _ = blob;
    }

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

/// Bytes `off..off + len` of a buffer of `size` bytes, or why they are
/// not in it.
fn host_range(size: usize, off: u64, len: usize) -> Result<std::ops::Range<usize>, TransportError> {
    usize::try_from(off)
        .ok()
        .and_then(|o| Some(o..o.checked_add(len)?))
        .filter(|r| r.end <= size)
        .ok_or_else(|| {
            TransportError::Invalid(format!(
                "bytes {off}..+{len} are outside a region of {size} bytes"
            ))
        })
}

/// Point-to-point messages of one byte, for transports whose operations
/// are bounded from the moment they are posted (NCCL): what
/// [`flow_handshake`] needs.
pub trait Exchange {
    /// Sends one byte to each of `to` and receives one byte from each of
    /// `from`, all at once; fails if that is not done by `deadline`. `what`
    /// says what the exchange is for, in errors.
    fn exchange(
        &mut self,
        to: &[u32],
        from: &[u32],
        deadline: Instant,
        what: &str,
    ) -> Result<(), TransportError>;
}

/// [`Comm::begin_flow`] over an [`Exchange`]: every member but the root
/// tells the root it is in the flow and waits for the root's answer, which
/// comes once all of them are. Each exchange goes one way between a pair
/// (NCCL fails with "Message truncated" when the two sides of a pair set
/// up different connections in one group: seen on an H200 with NCCL
/// 2.28). A member busy with earlier flows of the plan is waited for up to
/// `idle` (the NCCL backend: 5 timeouts); the collectives of the flow are
/// posted only after this, so their own timeout starts when every member
/// is there. Nothing to do for a rank outside `group`.
pub fn flow_handshake(
    x: &mut dyn Exchange,
    me: u32,
    root: u32,
    group: &[u32],
    idle: Duration,
) -> Result<(), TransportError> {
    let mut members: Vec<u32> = group.to_vec();
    members.sort_unstable();
    members.dedup();
    if !members.contains(&me) || members.len() < 2 {
        return Ok(());
    }
    let deadline = Instant::now() + idle;
    if me == root {
        let others: Vec<u32> = members.into_iter().filter(|m| *m != root).collect();
        x.exchange(
            &[],
            &others,
            deadline,
            &format!("waiting for ranks {others:?} to come to the flow of rank {root}"),
        )?;
        // A fresh bound: the last member may have come just in time.
        x.exchange(
            &others,
            &[],
            Instant::now() + idle,
            &format!("starting the flow of rank {root}"),
        )
    } else {
        // Two exchanges, as the root's: NCCL sets up the point-to-point
        // connections an exchange needs with its peers, and both sides of a
        // pair must ask for the same ones (one direction each time).
        x.exchange(
            &[root],
            &[],
            deadline,
            &format!("telling rank {root} this rank is in its flow"),
        )?;
        x.exchange(
            &[],
            &[root],
            deadline,
            &format!("waiting for rank {root} to start its flow"),
        )
    }
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

/// [`flow_handshake`] against a fake of NCCL's semantics: every operation's
/// timeout runs from the moment it is posted, whether or not its peers are
/// there yet.
#[cfg(test)]
mod handshake_tests {
    use std::collections::HashMap;
    use std::sync::mpsc::{Receiver, Sender, channel};

    use super::*;
    use crate::host::IDLE_FACTOR;
    use crate::shm::HostBuf;

    struct FakeNccl {
        me: u32,
        world: u32,
        timeout: Duration,
        /// Whether `begin_flow` runs the handshake (false: as the NCCL
        /// backend did before it had one).
        handshake: bool,
        to: HashMap<u32, Sender<Vec<u8>>>,
        from: HashMap<u32, Receiver<Vec<u8>>>,
    }

    impl FakeNccl {
        /// Ranks joined by one ordered channel per pair (NCCL keeps the
        /// order of messages between two ranks).
        fn ranks(world: u32, timeout: Duration, handshake: bool) -> Vec<FakeNccl> {
            let mut ranks: Vec<FakeNccl> = (0..world)
                .map(|me| FakeNccl {
                    me,
                    world,
                    timeout,
                    handshake,
                    to: HashMap::new(),
                    from: HashMap::new(),
                })
                .collect();
            for a in 0..world {
                for b in 0..world {
                    if a != b {
                        let (tx, rx) = channel();
                        ranks[a as usize].to.insert(b, tx);
                        ranks[b as usize].from.insert(a, rx);
                    }
                }
            }
            ranks
        }

        fn send(&self, peer: u32, bytes: Vec<u8>) {
            let _ = self.to[&peer].send(bytes);
        }

        fn recv(
            &self,
            peer: u32,
            deadline: Instant,
            what: &str,
        ) -> Result<Vec<u8>, TransportError> {
            let left = deadline.saturating_duration_since(Instant::now());
            self.from[&peer]
                .recv_timeout(left)
                .map_err(|_| TransportError::Timeout(format!("{what}: nothing from rank {peer}")))
        }
    }

    impl Exchange for FakeNccl {
        fn exchange(
            &mut self,
            to: &[u32],
            from: &[u32],
            deadline: Instant,
            what: &str,
        ) -> Result<(), TransportError> {
            for p in to {
                self.send(*p, vec![1]);
            }
            for p in from {
                self.recv(*p, deadline, what)?;
            }
            Ok(())
        }
    }

    impl Comm for FakeNccl {
        fn rank(&self) -> u32 {
            self.me
        }
        fn world(&self) -> u32 {
            self.world
        }
        /// The root's part ends when every member has the bytes (acks).
        fn broadcast(
            &mut self,
            root: u32,
            group: &[u32],
            buf: &mut dyn Region,
            offset: u64,
            len: u64,
        ) -> Result<(), TransportError> {
            let deadline = Instant::now() + self.timeout;
            let range = offset as usize..(offset + len) as usize;
            let what = format!("broadcast from rank {root}");
            if self.me == root {
                let bytes = buf.host().unwrap()[range].to_vec();
                let others: Vec<u32> = group.iter().copied().filter(|m| *m != root).collect();
                for m in &others {
                    self.send(*m, bytes.clone());
                }
                for m in &others {
                    self.recv(*m, deadline, &what)?;
                }
            } else if group.contains(&self.me) {
                let got = self.recv(root, deadline, &what)?;
                buf.host_mut().unwrap()[range].copy_from_slice(&got);
                self.send(root, vec![0xac]);
            }
            Ok(())
        }
        fn begin_flow(&mut self, root: u32, group: &[u32]) -> Result<(), TransportError> {
            if !self.handshake {
                return Ok(());
            }
            let (me, idle) = (self.me, self.timeout * IDLE_FACTOR);
            flow_handshake(self, me, root, group, idle)
        }
    }

    /// Flow A is {0, 1}, flow B {0, 2}, both from rank 0; rank 1 comes to
    /// A three timeouts late. Each rank's result and what rank 2 received.
    fn flows(handshake: bool) -> Vec<Result<Vec<u8>, TransportError>> {
        let timeout = Duration::from_millis(150);
        let threads: Vec<_> = FakeNccl::ranks(3, timeout, handshake)
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || {
                    let mut buf = HostBuf(vec![0; 16]);
                    let flows: &[(u8, [u32; 2])] = match c.me {
                        0 => &[(5, [0, 1]), (6, [0, 2])],
                        1 => &[(5, [0, 1])],
                        _ => &[(6, [0, 2])],
                    };
                    if c.me == 1 {
                        std::thread::sleep(3 * timeout);
                    }
                    for (seed, group) in flows {
                        if c.me == 0 {
                            buf.0 = vec![*seed; 16];
                        }
                        c.begin_flow(0, group)?;
                        c.broadcast(0, group, &mut buf, 0, 16)?;
                    }
                    Ok(buf.0)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn a_later_flow_waits_for_members_busy_with_an_earlier_one() {
        let got = flows(true);
        assert_eq!(got[1].as_ref().unwrap(), &vec![5; 16]);
        assert_eq!(got[2].as_ref().unwrap(), &vec![6; 16]);
        assert!(got[0].is_ok());
    }

    /// What the handshake is for: without it, the root times out in flow A
    /// and rank 2 in flow B (as the NCCL backend did on an H200).
    #[test]
    fn without_the_handshake_a_busy_member_costs_the_transfer() {
        let got = flows(false);
        for r in [0, 2] {
            assert!(
                matches!(&got[r], Err(TransportError::Timeout(_))),
                "rank {r}: {:?}",
                got[r].as_ref().map(|_| "ok")
            );
        }
    }

    #[test]
    fn outside_the_group_or_alone_there_is_nothing_to_wait_for() {
        let mut ranks = FakeNccl::ranks(2, Duration::from_millis(10), true);
        let idle = Duration::from_millis(10);
        flow_handshake(&mut ranks[1], 1, 0, &[0], idle).unwrap();
        flow_handshake(&mut ranks[0], 0, 0, &[0, 0], idle).unwrap();
        let e = flow_handshake(&mut ranks[0], 0, 0, &[0, 1], idle).unwrap_err();
        assert!(e.to_string().contains("waiting for ranks [1]"), "{e}");
    }
}
