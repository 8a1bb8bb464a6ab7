//! Runs this rank's part of a transfer plan over a connected [`Comm`].
//!
//! Every rank walks the plan's flows in the same order and joins the
//! collectives of the flows it is part of (as root or receiver), so the
//! ranks agree on the order of collectives without talking.
//!
//! Unpacked, each tensor is one broadcast, in place. Packed
//! ([`crate::pack`]), tensors are copied into a staging bucket and each
//! bucket is one broadcast; two staging buffers alternate so the root fills
//! bucket k+1 while bucket k is on the wire, and a receiver empties bucket
//! k-1 into its tensors while bucket k arrives.
//!
//! A key several putters put is one flow per putter ([`Lent::many`]): a
//! receiver takes each into its own destination set (by flow order or by
//! the putter's rank), or into scratch memory it reduces
//! ([`crate::reduce`]) and writes into its destination after the last.

use std::collections::HashMap;
use std::time::Instant;

use kt_types::Key;
use kt_types::tensor::{Device, Flow, ReduceOp, TensorSource, TensorStats, TransferPlan};

use crate::pack::{self, Bucket};
use crate::reduce::Accumulator;
use crate::transport::{Backend, Comm, Region, TransportError};

/// The memory this rank moves: per key, the mapped regions of its tensors
/// in set order (the source's where it roots a flow, the destination's where
/// it receives one); `many` says how a key several putters put is received.
#[derive(Debug)]
pub struct Lent {
    pub device: Device,
    pub keys: HashMap<Key, Vec<Box<dyn Region>>>,
    /// Keys received from several roots (one flow per putter).
    pub many: HashMap<Key, Many>,
}

/// How a receiver takes a key several putters put.
#[derive(Debug)]
pub enum Many {
    /// One destination set per flow of the key this rank receives, in plan
    /// order (putter rank ascending); none in `keys`.
    Each(Vec<Vec<Box<dyn Region>>>),
    /// The destination set of each putter rank; none in `keys`.
    ByRank(Vec<(u32, Vec<Box<dyn Region>>)>),
    /// Every flow is received into scratch memory beside the destination
    /// and reduced; the result goes into the key's set in `keys` after the
    /// last flow.
    Reduce(ReduceOp),
}

impl Lent {
    pub fn new(device: Device) -> Self {
        Lent {
            device,
            keys: HashMap::new(),
            many: HashMap::new(),
        }
    }

    /// Where the lent memory actually is: the device of a mapped region (a
    /// CUDA handle is mapped on the GPU its UUID names, which the agent may
    /// number differently from the application), else `device`.
    pub fn memory_device(&self) -> Device {
        let each = self.many.values().find_map(|m| match m {
            Many::Each(sets) => sets.iter().find_map(|s| s.first()),
            Many::ByRank(sets) => sets.iter().find_map(|(_, s)| s.first()),
            Many::Reduce(_) => None,
        });
        self.keys
            .values()
            .find_map(|v| v.first())
            .or(each)
            .map(|r| r.device())
            .unwrap_or(self.device)
    }
}

/// A key being reduced: scratch memory each flow arrives in, and the sum.
struct Reducing {
    scratch: Vec<Box<dyn Region>>,
    acc: Accumulator,
}

/// Runs every flow this rank takes part in.
pub fn run(
    backend: &dyn Backend,
    comm: &mut dyn Comm,
    plan: &TransferPlan,
    lent: &mut Lent,
) -> Result<TensorStats, TransportError> {
    let started = Instant::now();
    let me = comm.rank();
    let mut stats = TensorStats {
        backend: Some(plan.backend),
        rank: Some(me),
        world: Some(comm.world()),
        ..TensorStats::default()
    };
    let mut reducing = prepare_many(backend, plan, me, lent)?;
    let mut staging = Staging::for_plan(backend, &*comm, plan, lent)?;
    // Flows of each `Many::Each` key received so far.
    let mut received: HashMap<&Key, usize> = HashMap::new();
    for flow in &plan.flows {
        let group = flow.group();
        if !group.contains(&me) {
            continue;
        }
        let receiving = flow.root != me;
        let many = if receiving {
            lent.many.get_mut(&flow.key)
        } else {
            None
        };
        let regions = match many {
            Some(Many::Each(sets)) => {
                let i = received.entry(&flow.key).or_default();
                *i += 1;
                sets.get_mut(*i - 1)
            }
            Some(Many::ByRank(sets)) => sets
                .iter_mut()
                .find(|(r, _)| *r == flow.root)
                .map(|(_, s)| s),
            Some(Many::Reduce(_)) => reducing.get_mut(&flow.key).map(|r| &mut r.scratch),
            None => lent.keys.get_mut(&flow.key),
        };
        let regions = regions.ok_or_else(|| {
            TransportError::Invalid(format!(
                "rank {me} takes part in the flow of {} from rank {} but lent no memory for it",
                flow.key, flow.root
            ))
        })?;
        check_regions(flow, regions)?;
        comm.begin_flow(flow.root, &group)?;
        if plan.packing.pack {
            packed(
                backend,
                comm,
                flow,
                &group,
                regions,
                plan.packing.bucket_bytes,
                &mut staging.slots,
                &mut stats,
            )?;
        } else {
            for (t, r) in flow.tensors.iter().zip(regions.iter_mut()) {
                let len = t.meta.nbytes().map_err(TransportError::Invalid)?;
                if len > 0 {
                    comm.broadcast(flow.root, &group, &mut **r, 0, len)?;
                    stats.collectives += 1;
                }
            }
        }
        stats.tensors += flow.tensors.len() as u64;
        stats.bytes += regions.iter().map(|r| r.len()).sum::<u64>();
        if let Some(r) = reducing.get_mut(&flow.key).filter(|_| receiving) {
            for (i, s) in r.scratch.iter().enumerate() {
                let mut bytes = vec![0; s.len() as usize];
                backend.read(&**s, 0, &mut bytes)?;
                r.acc.add(i, &bytes)?;
            }
            r.acc.end_set();
        }
        if receiving {
            let from = &plan.ranks[flow.root as usize];
            stats.sources.push(TensorSource {
                key: flow.key.clone(),
                rank: flow.root,
                agent: from.agent.clone(),
                member: from.member.clone(),
            });
        }
    }
    for (key, r) in reducing {
        if r.acc.count() == 0 {
            return Err(TransportError::Invalid(format!(
                "rank {me} asked for a reduction of {key}, and no putter's tensors came"
            )));
        }
        let dest = lent.keys.get_mut(&key).ok_or_else(|| {
            TransportError::Invalid(format!("{key}: no destination for its reduction"))
        })?;
        for (d, bytes) in dest.iter_mut().zip(r.acc.finish()) {
            backend.write(&mut **d, 0, &bytes)?;
        }
    }
    stats.seconds = started.elapsed().as_secs_f64();
    Ok(stats)
}

/// Checks what this rank lent for keys of several putters against the
/// plan (before anything moves), and allocates the scratch memory of each
/// reduction beside the destination.
fn prepare_many(
    backend: &dyn Backend,
    plan: &TransferPlan,
    me: u32,
    lent: &Lent,
) -> Result<HashMap<Key, Reducing>, TransportError> {
    let mut reducing = HashMap::new();
    for (key, many) in &lent.many {
        let flows: Vec<&Flow> = plan
            .flows
            .iter()
            .filter(|f| &f.key == key && f.receivers.contains(&me))
            .collect();
        match many {
            Many::Each(sets) if sets.len() != flows.len() => {
                return Err(TransportError::Invalid(format!(
                    "{key}: {} destination sets lent for {} putters",
                    sets.len(),
                    flows.len()
                )));
            }
            Many::ByRank(sets) => {
                if let Some((r, _)) = sets
                    .iter()
                    .find(|(r, _)| !flows.iter().any(|f| f.root == *r))
                {
                    return Err(TransportError::Invalid(format!(
                        "{key}: rank {r} sends this rank nothing in transfer {}",
                        plan.id
                    )));
                }
            }
            Many::Reduce(op) => {
                let Some(first) = flows.first() else {
                    continue;
                };
                let acc = Accumulator::new(*op, &first.tensors)
                    .map_err(|e| TransportError::Invalid(format!("{key}: {e}")))?;
                let device = lent
                    .keys
                    .get(key)
                    .and_then(|v| v.first())
                    .map(|r| r.device())
                    .unwrap_or(lent.device);
                let scratch = first
                    .tensors
                    .iter()
                    .map(|t| {
                        let len = t.meta.nbytes().map_err(TransportError::Invalid)?;
                        backend.alloc(device, len)
                    })
                    .collect::<Result<_, _>>()?;
                reducing.insert(key.clone(), Reducing { scratch, acc });
            }
            Many::Each(_) => {}
        }
    }
    Ok(reducing)
}

/// How one rank's transfer gets its communicator.
pub enum Link<'a> {
    /// Connects anew ([`Backend::connect`]) with rank 0's rendezvous blob.
    Connect {
        endpoint: Box<dyn crate::transport::Endpoint>,
        rendezvous: Option<&'a str>,
    },
    /// Runs on a communicator kept from an earlier transfer of the same
    /// ranks ([`transfer_on`] gave it back).
    Reuse(Box<dyn Comm>),
}

impl std::fmt::Debug for Link<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Link::Connect { endpoint, .. } => f
                .debug_struct("Connect")
                .field("endpoint", &endpoint.address())
                .finish(),
            Link::Reuse(c) => f
                .debug_struct("Reuse")
                .field("rank", &c.rank())
                .field("world", &c.world())
                .finish(),
        }
    }
}

/// One rank's whole transfer: holds the device of `lent` (see
/// [`Backend::hold`]), connects, runs the plan, and drops the communicator
/// and the lent memory before letting the device go (or, when the
/// communicator is wedged, hands the memory and the hold to it until its
/// kernels have stopped: [`Comm::keep_until_stopped`]).
pub fn transfer(
    backend: &dyn Backend,
    plan: &TransferPlan,
    rank: u32,
    endpoint: Box<dyn crate::transport::Endpoint>,
    rendezvous: Option<&str>,
    lent: Lent,
    timeout: std::time::Duration,
) -> Result<TensorStats, TransportError> {
    let link = Link::Connect {
        endpoint,
        rendezvous,
    };
    transfer_on(backend, plan, rank, link, lent, timeout).0
}

/// [`transfer`] over `link`, giving the communicator back when it can run
/// another transfer of the same ranks ([`Comm::reusable`] after a plan
/// that ran to its end): the caller may keep it for the next one.
pub fn transfer_on(
    backend: &dyn Backend,
    plan: &TransferPlan,
    rank: u32,
    link: Link<'_>,
    mut lent: Lent,
    timeout: std::time::Duration,
) -> (Result<TensorStats, TransportError>, Option<Box<dyn Comm>>) {
    let device = lent.memory_device();
    // Whatever is freed before the hold is let go waits for it (and for
    // any other transfer on the device): the order of drops does not matter.
    let held = match backend.hold(device, timeout) {
        Ok(h) => h,
        Err(e) => {
            // The device is stuck freeing: a kept communicator is closed
            // after that, as every free there (not here, behind it).
            if let Link::Reuse(c) = link {
                backend.retire(device, c);
            }
            return (Err(e), None);
        }
    };
    let reused = matches!(link, Link::Reuse(_));
    let mut comm = match link {
        Link::Connect {
            endpoint,
            rendezvous,
        } => match backend.connect(plan, rank, endpoint, rendezvous, device, timeout) {
            Ok(c) => c,
            Err(e) => return (Err(e), None),
        },
        Link::Reuse(c) => {
            let world = plan.ranks.len() as u32;
            if (c.rank(), c.world()) != (rank, world) {
                let e = TransportError::Invalid(format!(
                    "transfer {}: the kept communicator is rank {} of {}, the plan says {rank} of {world}",
                    plan.id,
                    c.rank(),
                    c.world()
                ));
                return (Err(e), None);
            }
            c
        }
    };
    comm.rename(&plan.id);
    let stats = run(backend, &mut *comm, plan, &mut lent).map(|s| TensorStats { reused, ..s });
    if comm.wedged() {
        // Its kernels may still run (an abort that did not return): the
        // memory they may touch stays mapped and allocated, and the device
        // held, so nothing deferred on it is freed under them, until the
        // abort returns (then all of it goes, as after any transfer).
        comm.keep_until_stopped(Box::new((lent, held)));
        drop(comm);
        return (stats, None);
    }
    let kept = (stats.is_ok() && comm.reusable()).then_some(comm);
    drop((lent, held));
    (stats, kept)
}

fn check_regions(flow: &Flow, regions: &[Box<dyn Region>]) -> Result<(), TransportError> {
    if regions.len() != flow.tensors.len() {
        return Err(TransportError::Invalid(format!(
            "{}: the plan moves {} tensors, {} were lent",
            flow.key,
            flow.tensors.len(),
            regions.len()
        )));
    }
    for (t, r) in flow.tensors.iter().zip(regions) {
        let want = t.meta.nbytes().map_err(TransportError::Invalid)?;
        if r.len() != want {
            return Err(TransportError::Invalid(format!(
                "{} tensor {:?}: {} needs {want} bytes, the lent memory has {}",
                flow.key,
                t.name,
                t.meta,
                r.len()
            )));
        }
    }
    Ok(())
}

fn items(b: &Bucket) -> &[pack::Item] {
    match b {
        Bucket::Packed { items, .. } => items,
        Bucket::Direct { .. } => &[],
    }
}

/// Root: copies a bucket's tensors into `staging`.
fn fill(
    backend: &dyn Backend,
    staging: &mut dyn Region,
    bucket: &Bucket,
    regions: &[Box<dyn Region>],
) -> Result<(), TransportError> {
    for it in items(bucket) {
        backend.copy(staging, it.offset, &*regions[it.index], 0, it.len)?;
    }
    Ok(())
}

/// Receiver: copies a received bucket out into the tensors.
fn drain(
    backend: &dyn Backend,
    staging: &dyn Region,
    bucket: &Bucket,
    regions: &mut [Box<dyn Region>],
) -> Result<(), TransportError> {
    for it in items(bucket) {
        backend.copy(&mut *regions[it.index], 0, staging, it.offset, it.len)?;
    }
    Ok(())
}

fn joined(r: std::thread::Result<Result<(), TransportError>>) -> Result<(), TransportError> {
    r.unwrap_or_else(|_| Err(TransportError::Peer("a pack thread panicked".into())))
}

#[allow(clippy::too_many_arguments)]
fn packed(
    backend: &dyn Backend,
    comm: &mut dyn Comm,
    flow: &Flow,
    group: &[u32],
    regions: &mut [Box<dyn Region>],
    bucket_bytes: u64,
    slots: &mut [Box<dyn Region>],
    stats: &mut TensorStats,
) -> Result<(), TransportError> {
    let buckets = pack::plan(&flow.tensors, bucket_bytes);
    if comm.gathers() {
        return gathered(comm, flow, group, regions, &buckets, stats);
    }
    let packed_at = packed_buckets(&buckets);
    if slots.len() < packed_at.len().min(2)
        || slots.iter().any(|s| s.len() < pack::staging_len(&buckets))
    {
        return Err(TransportError::Invalid(format!(
            "{}: the staging buffers were sized for another plan",
            flow.key
        )));
    }
    let is_root = comm.rank() == flow.root;
    if is_root && let Some(&first) = packed_at.first() {
        fill(backend, &mut *slots[0], &buckets[first], regions)?;
    }
    // Receiver: the packed bucket whose bytes wait in its slot.
    let mut pending: Option<usize> = None;
    let mut k = 0; // packed buckets seen
    for (bi, bucket) in buckets.iter().enumerate() {
        match bucket {
            Bucket::Direct { index, len } => {
                if let Some(p) = pending.take() {
                    let slot = &*slots[packed_slot(&packed_at, p)];
                    drain(backend, slot, &buckets[p], regions)?;
                }
                comm.broadcast(flow.root, group, &mut *regions[*index], 0, *len)?;
            }
            Bucket::Packed { len, .. } => {
                let (cur, other) = split(slots, k % 2);
                let next = packed_at.get(k + 1).copied();
                let prev = pending.take();
                let regions_ref = &mut *regions;
                let buckets_ref = &buckets;
                std::thread::scope(|s| {
                    let helper = match (is_root, next, prev, other) {
                        (true, Some(nb), _, Some(o)) => {
                            let regions: &[Box<dyn Region>] = regions_ref;
                            Some(
                                s.spawn(move || fill(backend, &mut **o, &buckets_ref[nb], regions)),
                            )
                        }
                        (false, _, Some(pb), Some(o)) => Some(
                            s.spawn(move || drain(backend, &**o, &buckets_ref[pb], regions_ref)),
                        ),
                        _ => None,
                    };
                    let sent = comm.broadcast(flow.root, group, &mut **cur, 0, *len);
                    let helped = helper.map(|h| joined(h.join())).unwrap_or(Ok(()));
                    sent.and(helped)
                })?;
                if !is_root {
                    pending = Some(bi);
                }
                k += 1;
            }
        }
        stats.collectives += 1;
    }
    if let Some(p) = pending {
        let slot = &*slots[packed_slot(&packed_at, p)];
        drain(backend, slot, &buckets[p], regions)?;
    }
    Ok(())
}

/// Packing where the transport gathers and scatters: each bucket is one
/// collective over the tensors themselves, no staging copy.
fn gathered(
    comm: &mut dyn Comm,
    flow: &Flow,
    group: &[u32],
    regions: &mut [Box<dyn Region>],
    buckets: &[Bucket],
    stats: &mut TensorStats,
) -> Result<(), TransportError> {
    for bucket in buckets {
        match bucket {
            Bucket::Direct { index, len } => {
                comm.broadcast(flow.root, group, &mut *regions[*index], 0, *len)?;
            }
            Bucket::Packed { items, .. } => {
                // Items are in set order (ascending indices): one pass picks them.
                let mut want = items.iter().map(|i| i.index).peekable();
                let mut parts: Vec<&mut dyn Region> = Vec::with_capacity(items.len());
                for (i, r) in regions.iter_mut().enumerate() {
                    if want.peek() == Some(&i) {
                        want.next();
                        parts.push(&mut **r);
                    }
                }
                if want.next().is_some() {
                    return Err(TransportError::Invalid(
                        "a bucket's tensors are out of order".into(),
                    ));
                }
                comm.broadcast_parts(flow.root, group, &mut parts)?;
            }
        }
        stats.collectives += 1;
    }
    Ok(())
}

/// Indices of the packed buckets (those that go through staging).
fn packed_buckets(buckets: &[Bucket]) -> Vec<usize> {
    buckets
        .iter()
        .enumerate()
        .filter(|(_, b)| matches!(b, Bucket::Packed { .. }))
        .map(|(i, _)| i)
        .collect()
}

/// The staging buffers of one rank's whole plan, allocated once before its
/// first flow and dropped after its last: allocating and freeing device
/// memory per flow would synchronise the GPU behind whatever else runs on
/// it (NCCL kernels of other transfers waiting for their peers). Two
/// buffers (double buffering) of the largest bucket any of this rank's
/// packed flows has; none where nothing is packed or the transport gathers.
struct Staging {
    slots: Vec<Box<dyn Region>>,
}

impl Staging {
    fn for_plan(
        backend: &dyn Backend,
        comm: &dyn Comm,
        plan: &TransferPlan,
        lent: &Lent,
    ) -> Result<Staging, TransportError> {
        if !plan.packing.pack || comm.gathers() {
            return Ok(Staging { slots: Vec::new() });
        }
        let me = comm.rank();
        let (mut count, mut cap) = (0, 0);
        for flow in plan.flows.iter().filter(|f| f.group().contains(&me)) {
            let buckets = pack::plan(&flow.tensors, plan.packing.bucket_bytes);
            count = count.max(packed_buckets(&buckets).len().min(2));
            cap = cap.max(pack::staging_len(&buckets));
        }
        // Beside the tensors (their mapped device, not the entry's index).
        let device = lent.memory_device();
        let slots = (0..count)
            .map(|_| backend.alloc(device, cap))
            .collect::<Result<_, _>>()?;
        Ok(Staging { slots })
    }
}

fn packed_slot(packed_at: &[usize], bucket: usize) -> usize {
    packed_at.iter().position(|b| *b == bucket).unwrap_or(0) % 2
}

/// The slot in use and (when there are two) the other one.
fn split(
    slots: &mut [Box<dyn Region>],
    cur: usize,
) -> (&mut Box<dyn Region>, Option<&mut Box<dyn Region>>) {
    let (a, b) = slots.split_at_mut(1);
    let (a, b) = (&mut a[0], b.first_mut());
    match b {
        None => (a, None),
        Some(b) if cur == 0 => (a, Some(b)),
        Some(b) => (b, Some(a)),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::host::tests::on_every_rank;
    use crate::shm::HostBuf;
    use kt_types::tensor::{DType, Packing, TensorDesc, TensorMeta};

    fn descs() -> Vec<TensorDesc> {
        let mut v = Vec::new();
        for i in 0..40u64 {
            let dtype = [DType::F32, DType::F16, DType::I64][(i % 3) as usize];
            v.push(TensorDesc {
                name: format!("layer{i}.weight"),
                meta: TensorMeta::new(dtype, [i * 37 + 1, 3]),
            });
        }
        v.push(TensorDesc {
            name: "huge".into(),
            meta: TensorMeta::new(DType::U8, [3 << 20]),
        });
        v.push(TensorDesc {
            name: "empty".into(),
            meta: TensorMeta::new(DType::F32, [0]),
        });
        v
    }

    fn content(rank_seed: u8, d: &TensorDesc) -> Vec<u8> {
        let n = d.meta.nbytes().unwrap() as usize;
        (0..n)
            .map(|i| {
                (i as u8)
                    .wrapping_mul(31)
                    .wrapping_add(rank_seed)
                    .wrapping_add(d.name.len() as u8)
            })
            .collect()
    }

    /// The host communicator as NCCL's behaves: it cannot gather (packing
    /// goes through the staging buffers and their double buffering), and
    /// it can be kept for another transfer when the flag says so.
    struct Staged(Box<dyn Comm>, bool);

    impl Comm for Staged {
        fn rank(&self) -> u32 {
            self.0.rank()
        }
        fn world(&self) -> u32 {
            self.0.world()
        }
        fn broadcast(
            &mut self,
            root: u32,
            group: &[u32],
            buf: &mut dyn Region,
            offset: u64,
            len: u64,
        ) -> Result<(), TransportError> {
            self.0.broadcast(root, group, buf, offset, len)
        }
        fn begin_flow(&mut self, root: u32, group: &[u32]) -> Result<(), TransportError> {
            self.0.begin_flow(root, group)
        }
        fn reusable(&self) -> bool {
            self.1
        }
    }

    /// The host backend, counting the staging buffers it hands out, and
    /// holding its device as the NCCL backend does when given `holds`.
    #[derive(Debug)]
    struct Counting<'a> {
        inner: &'a dyn Backend,
        allocs: std::sync::atomic::AtomicUsize,
        holds: Option<std::sync::Arc<crate::hold::DeviceHolds>>,
    }

    impl Backend for Counting<'_> {
        fn kind(&self) -> kt_types::tensor::BackendKind {
            self.inner.kind()
        }
        fn hold(
            &self,
            _device: Device,
            wait: Duration,
        ) -> Result<Option<Box<dyn Send>>, TransportError> {
            match &self.holds {
                Some(h) => Ok(Some(Box::new(h.hold(0, wait)?))),
                None => Ok(None),
            }
        }
        fn retire(&self, _device: Device, comm: Box<dyn Comm>) {
            match &self.holds {
                Some(h) => h.defer(0, "the close of a retired communicator", Box::new(comm)),
                None => drop(comm),
            }
        }
        fn map(
            &self,
            handle: &kt_types::tensor::MemHandle,
            device: Device,
        ) -> Result<Box<dyn Region>, TransportError> {
            self.inner.map(handle, device)
        }
        fn alloc(&self, device: Device, len: u64) -> Result<Box<dyn Region>, TransportError> {
            self.allocs
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.inner.alloc(device, len)
        }
        fn copy(
            &self,
            dst: &mut dyn Region,
            dst_off: u64,
            src: &dyn Region,
            src_off: u64,
            len: u64,
        ) -> Result<(), TransportError> {
            self.inner.copy(dst, dst_off, src, src_off, len)
        }
        fn endpoint(
            &self,
            id: &str,
            ip: &str,
        ) -> Result<Box<dyn crate::transport::Endpoint>, TransportError> {
            self.inner.endpoint(id, ip)
        }
        fn rendezvous(&self, plan: &TransferPlan) -> Result<Option<String>, TransportError> {
            self.inner.rendezvous(plan)
        }
        fn connect(
            &self,
            plan: &TransferPlan,
            rank: u32,
            endpoint: Box<dyn crate::transport::Endpoint>,
            rendezvous: Option<&str>,
            device: Device,
            timeout: Duration,
        ) -> Result<Box<dyn Comm>, TransportError> {
            self.inner
                .connect(plan, rank, endpoint, rendezvous, device, timeout)
        }
    }

    /// An abort slower than its wait used to keep the device held for the
    /// agent's life (nothing deferred on it was freed again); now the hold
    /// and the lent memory go once the abort returns.
    #[test]
    fn a_wedged_transfer_lets_its_device_go_once_the_abort_returns() {
        use std::sync::Arc;
        use std::sync::atomic::Ordering;

        let holds = Arc::new(crate::hold::DeviceHolds::default());
        let host = crate::HostBackend::new("/dev/shm");
        let b = Counting {
            inner: &host,
            allocs: Default::default(),
            holds: Some(holds.clone()),
        };
        let mut plan = crate::host::tests::plan_of(2, 1, &["a".into(), "b".into()]);
        plan.flows.clear();
        let reaper = crate::hold::Reaper::default();
        let link = Link::Reuse(Box::new(crate::testing::FakeComm::wedged(&reaper)));
        let (_, kept) = transfer_on(
            &b,
            &plan,
            0,
            link,
            Lent::new(Device::Cpu),
            Duration::from_secs(5),
        );
        assert!(kept.is_none(), "a wedged communicator is never kept");
        // Its kernels may still run: the device stays held, and what is
        // freed meanwhile waits.
        assert_eq!(holds.holders(0), 1);
        let (freed, item) = crate::hold::tests::flag();
        holds.defer(0, "a test's flag", item);
        assert!(!freed.load(Ordering::SeqCst));
        // The abort returns.
        reaper.returned();
        assert_eq!(holds.holders(0), 0, "the device is let go");
        assert!(freed.load(Ordering::SeqCst), "what waited is freed");
    }

    /// A transfer that finds its device stuck freeing (its last transfer's
    /// free does not return) used to wait for good before it connected;
    /// now it fails within its timeout saying what is stuck, and a kept
    /// communicator it was to run on is closed after the stuck free, not
    /// behind it on this thread.
    #[test]
    fn a_transfer_on_a_device_stuck_freeing_fails_within_its_timeout() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::mpsc::channel;

        let holds = Arc::new(crate::hold::DeviceHolds::default());
        let (go, draining) =
            crate::hold::tests::stuck_drain(&holds, 0, "the close of a retired NCCL communicator");
        let closed = Arc::new(AtomicUsize::new(0));
        let comm = crate::testing::FakeComm::counting_drops(&closed);
        let (tx, rx) = channel();
        let h = holds.clone();
        std::thread::spawn(move || {
            let host = crate::HostBackend::new("/dev/shm");
            let b = Counting {
                inner: &host,
                allocs: Default::default(),
                holds: Some(h),
            };
            let mut plan = crate::host::tests::plan_of(2, 1, &["a".into(), "b".into()]);
            plan.flows.clear();
            let link = Link::Reuse(Box::new(comm));
            let timeout = Duration::from_millis(300);
            let (res, kept) = transfer_on(&b, &plan, 0, link, Lent::new(Device::Cpu), timeout);
            let _ = tx.send((res, kept.is_some()));
        });
        let (res, kept) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the transfer returns while the device is stuck freeing");
        assert!(!kept);
        let e = res.unwrap_err();
        assert!(matches!(e, TransportError::Timeout(_)), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("the close of a retired NCCL communicator has not returned"),
            "{msg}"
        );
        assert_eq!(
            closed.load(Ordering::SeqCst),
            0,
            "closed behind the stuck free"
        );
        go.send(()).unwrap();
        draining.join().unwrap();
        assert_eq!(
            closed.load(Ordering::SeqCst),
            1,
            "closed once the drain went on"
        );
        assert_eq!(holds.holders(0), 0);
    }

    /// Three ranks: 0 puts `a`, 1 puts `b`, 2 gets both, 1 also gets `a`.
    fn many_to_many(packing: Packing) -> (Vec<TensorStats>, Vec<Lent>) {
        let (stats, lents, _) = many_to_many_over(packing, false);
        (stats, lents)
    }

    /// Each rank's stats, its lent memory afterwards, and how many staging
    /// buffers it allocated.
    fn many_to_many_over(
        packing: Packing,
        staged: bool,
    ) -> (Vec<TensorStats>, Vec<Lent>, Vec<usize>) {
        let ka = Key::parse("m/a").unwrap();
        let kb = Key::parse("m/b").unwrap();
        let set = descs();
        let lent_of = |rank: usize| {
            let mut l = Lent::new(Device::Cpu);
            let region = |seed: Option<u8>| -> Vec<Box<dyn Region>> {
                set.iter()
                    .map(|d| {
                        let bytes = match seed {
                            Some(s) => content(s, d),
                            None => vec![0; d.meta.nbytes().unwrap() as usize],
                        };
                        Box::new(HostBuf(bytes)) as Box<dyn Region>
                    })
                    .collect()
            };
            match rank {
                0 => {
                    l.keys.insert(ka.clone(), region(Some(1)));
                }
                1 => {
                    l.keys.insert(ka.clone(), region(None));
                    l.keys.insert(kb.clone(), region(Some(2)));
                }
                _ => {
                    l.keys.insert(ka.clone(), region(None));
                    l.keys.insert(kb.clone(), region(None));
                }
            }
            l
        };
        let configure = |plan: &mut TransferPlan| {
            plan.id = "t-m2m".into();
            plan.flows = vec![
                Flow {
                    key: ka.clone(),
                    version: "1".into(),
                    root: 0,
                    receivers: vec![1, 2],
                    tensors: set.clone(),
                },
                Flow {
                    key: kb.clone(),
                    version: "1".into(),
                    root: 1,
                    receivers: vec![2],
                    tensors: set.clone(),
                },
            ];
            plan.packing = packing;
            plan.fanout = 1;
            plan.validate().unwrap();
        };
        let per_rank = on_every_rank(3, configure, Duration::from_secs(20), |r, b, plan, c| {
            let mut lent = lent_of(r);
            let b = Counting {
                inner: b,
                allocs: Default::default(),
                holds: None,
            };
            let st = if staged {
                run(&b, &mut Staged(c, false), plan, &mut lent)
            } else {
                let mut c = c;
                run(&b, &mut *c, plan, &mut lent)
            }
            .unwrap();
            (st, lent, b.allocs.into_inner())
        });
        let mut out = (Vec::new(), Vec::new(), Vec::new());
        for (st, lent, allocs) in per_rank {
            out.0.push(st);
            out.1.push(lent);
            out.2.push(allocs);
        }
        out
    }

    fn check(lents: &[Lent]) {
        let set = descs();
        let ka = Key::parse("m/a").unwrap();
        let kb = Key::parse("m/b").unwrap();
        for (rank, key, seed) in [(1, &ka, 1), (2, &ka, 1), (2, &kb, 2)] {
            let got = &lents[rank].keys[key];
            for (d, r) in set.iter().zip(got) {
                assert!(
                    r.host().unwrap() == content(seed, d).as_slice(),
                    "rank {rank} {key} {}",
                    d.name
                );
            }
        }
    }

    #[test]
    fn unpacked_many_to_many_moves_every_tensor() {
        let (stats, lents) = many_to_many(Packing::default());
        check(&lents);
        // One collective per non-empty tensor and flow.
        assert_eq!(stats[2].collectives, 2 * 41);
        assert_eq!(stats[0].collectives, 41);
        assert_eq!(stats[2].tensors, 84);
    }

    #[test]
    fn packed_many_to_many_moves_every_tensor_in_few_collectives() {
        let (stats, lents) = many_to_many(Packing {
            pack: true,
            bucket_bytes: 1 << 20,
        });
        check(&lents);
        let per_flow = pack::plan(&descs(), 1 << 20).len() as u64;
        assert!(per_flow < 10, "{per_flow} buckets");
        assert_eq!(stats[2].collectives, 2 * per_flow);
        assert_eq!(stats[1].collectives, 2 * per_flow);
    }

    #[test]
    fn packing_through_staging_buffers_moves_every_tensor() {
        let packing = Packing {
            pack: true,
            bucket_bytes: 1 << 20,
        };
        let (stats, lents, allocs) = many_to_many_over(packing, true);
        check(&lents);
        let per_flow = pack::plan(&descs(), 1 << 20).len() as u64;
        assert_eq!(stats[2].collectives, 2 * per_flow);
        // Staging is allocated once per plan, not per flow (#19): ranks 1
        // and 2 each take part in two packed flows.
        assert_eq!(allocs, vec![2, 2, 2]);
    }

    /// Three putters of one key (ranks 0..3, a flow each) and three
    /// receivers: every putter's into its own set, two by rank, and the
    /// sum; packed and not. Each putter's i32 elements are `100 r + i`.
    fn several_putters(packing: Packing) {
        let key = Key::parse("sync/g").unwrap();
        let desc = TensorDesc {
            name: String::new(),
            meta: TensorMeta::new(DType::I32, [64]),
        };
        let configure = |plan: &mut TransferPlan| {
            plan.packing = packing;
            plan.flows = (0..3)
                .map(|root| Flow {
                    key: key.clone(),
                    version: "1".into(),
                    root,
                    receivers: if root == 1 { vec![3, 4, 5] } else { vec![3, 5] },
                    tensors: vec![desc.clone()],
                })
                .collect();
            plan.validate().unwrap();
        };
        let values =
            |r: i32| -> Vec<u8> { (0..64).flat_map(|i| (100 * r + i).to_le_bytes()).collect() };
        let zero = || -> Vec<Box<dyn Region>> { vec![Box::new(HostBuf(vec![0; 256]))] };
        let got = on_every_rank(
            6,
            configure,
            Duration::from_secs(20),
            |r, b, plan, mut c| {
                let mut lent = Lent::new(Device::Cpu);
                match r {
                    0..=2 => {
                        lent.keys
                            .insert(key.clone(), vec![Box::new(HostBuf(values(r as i32)))]);
                    }
                    3 => {
                        lent.many
                            .insert(key.clone(), Many::Each((0..3).map(|_| zero()).collect()));
                    }
                    4 => {
                        lent.many
                            .insert(key.clone(), Many::ByRank(vec![(1, zero())]));
                    }
                    _ => {
                        lent.keys.insert(key.clone(), zero());
                        lent.many.insert(key.clone(), Many::Reduce(ReduceOp::Sum));
                    }
                }
                let stats = run(b, &mut *c, plan, &mut lent).unwrap();
                let host = |regions: &[Box<dyn Region>]| regions[0].host().unwrap().to_vec();
                let got: Vec<Vec<u8>> = match lent.many.remove(&key) {
                    Some(Many::Each(sets)) => sets.iter().map(|s| host(s)).collect(),
                    Some(Many::ByRank(sets)) => sets.iter().map(|(_, s)| host(s)).collect(),
                    _ => vec![host(&lent.keys[&key])],
                };
                let from: Vec<u32> = stats.sources.iter().map(|s| s.rank).collect();
                (got, from)
            },
        );
        assert_eq!(got[3].0, vec![values(0), values(1), values(2)]);
        assert_eq!(got[3].1, [0, 1, 2]);
        assert_eq!(got[4].0, vec![values(1)]);
        assert_eq!(got[4].1, [1]);
        let sum: Vec<u8> = (0..64i32)
            .flat_map(|i| (300 + 3 * i).to_le_bytes())
            .collect();
        assert_eq!(got[5].0, vec![sum]);
        // A putter receives nothing.
        assert!(got[0].1.is_empty());
    }

    #[test]
    fn receivers_of_several_putters_take_each_one_some_or_the_sum() {
        several_putters(Packing::default());
        several_putters(Packing {
            pack: true,
            bucket_bytes: 1 << 20,
        });
    }

    /// Flows `a: 0 -> {1}` then `b: 0 -> {1, 2}`: rank 2 is in `b` only,
    /// and reaches it long before ranks 0 and 1 do (they are busy for three
    /// timeouts first, as with a large `a`): it waits for them, idle, and
    /// gets `b`.
    #[test]
    fn a_rank_waits_for_flows_before_its_own_longer_than_the_timeout() {
        let (ka, kb) = (Key::parse("m/a").unwrap(), Key::parse("m/b").unwrap());
        let desc = TensorDesc {
            name: "w".into(),
            meta: TensorMeta::new(DType::U8, [1 << 20]),
        };
        let flow = |key: &Key, receivers| Flow {
            key: key.clone(),
            version: "1".into(),
            root: 0,
            receivers,
            tensors: vec![desc.clone()],
        };
        let configure = |plan: &mut TransferPlan| {
            plan.flows = vec![flow(&ka, vec![1]), flow(&kb, vec![1, 2])];
            plan.validate().unwrap();
        };
        let timeout = Duration::from_millis(200);
        let got = on_every_rank(3, configure, timeout, |r, b, plan, mut c| {
            let mut lent = Lent::new(Device::Cpu);
            let fill = |seed: u8| -> Vec<Box<dyn Region>> {
                let bytes = if r == 0 {
                    content(seed, &desc)
                } else {
                    vec![0; 1 << 20]
                };
                vec![Box::new(HostBuf(bytes))]
            };
            if r < 2 {
                lent.keys.insert(ka.clone(), fill(1));
            }
            lent.keys.insert(kb.clone(), fill(2));
            if r < 2 {
                std::thread::sleep(timeout * 3);
            }
            run(b, &mut *c, plan, &mut lent).unwrap();
            lent.keys[&kb][0].host().unwrap().to_vec()
        });
        for (r, bytes) in got.iter().enumerate() {
            assert!(*bytes == content(2, &desc), "rank {r} got other bytes");
        }
    }

    /// Rounds of one group (an RL loop's weight syncs): the communicator
    /// the first transfer gives back runs the next ones, with fresh plans;
    /// one that failed or cannot be kept is not given back, and one kept
    /// for other ranks is refused.
    #[test]
    fn a_kept_communicator_runs_the_next_rounds() {
        let desc = TensorDesc {
            name: "w".into(),
            meta: TensorMeta::new(DType::U8, [4096]),
        };
        let key = Key::parse("rl/weights").unwrap();
        let configure = |plan: &mut TransferPlan| {
            plan.flows = vec![Flow {
                key: key.clone(),
                version: "1".into(),
                root: 0,
                receivers: vec![1, 2],
                tensors: vec![desc.clone()],
            }];
        };
        let timeout = Duration::from_secs(10);
        let got = on_every_rank(3, configure, timeout, |r, b, plan, c| {
            let lent = |seed: u8| {
                let mut l = Lent::new(Device::Cpu);
                let bytes = if r == 0 {
                    content(seed, &desc)
                } else {
                    vec![0; 4096]
                };
                l.keys.insert(
                    key.clone(),
                    vec![Box::new(HostBuf(bytes)) as Box<dyn Region>],
                );
                l
            };
            let mut comm: Box<dyn Comm> = Box::new(Staged(c, true));
            for round in 0..3u8 {
                let mut p = plan.clone();
                p.id = format!("round-{round}");
                let (res, back) =
                    transfer_on(b, &p, r as u32, Link::Reuse(comm), lent(round), timeout);
                let stats = res.unwrap();
                assert_eq!(stats.collectives, 1, "rank {r}, round {round}");
                assert!(stats.reused);
                comm = back.expect("a reusable communicator is given back");
            }
            // Still in step with the others: one more plan, its bytes checked.
            let mut last = lent(7);
            run(b, &mut *comm, plan, &mut last).unwrap();
            assert!(
                last.keys[&key][0].host().unwrap() == content(7, &desc),
                "rank {r}"
            );
            // Kept for rank r, offered as another rank: refused, not run.
            let other = (r as u32 + 1) % 3;
            let (res, back) = transfer_on(b, plan, other, Link::Reuse(comm), lent(9), timeout);
            assert!(back.is_none());
            assert!(
                res.unwrap_err()
                    .to_string()
                    .contains("kept communicator is rank"),
                "rank {r}"
            );
            r
        });
        assert_eq!(got, vec![0, 1, 2]);
    }

    #[test]
    fn a_communicator_that_cannot_be_kept_is_not_given_back() {
        let configure = |plan: &mut TransferPlan| {
            plan.flows[0].tensors = vec![TensorDesc {
                name: "w".into(),
                meta: TensorMeta::new(DType::U8, [64]),
            }];
        };
        on_every_rank(2, configure, Duration::from_secs(5), |r, b, plan, c| {
            let mut lent = Lent::new(Device::Cpu);
            lent.keys.insert(
                plan.flows[0].key.clone(),
                vec![Box::new(HostBuf(vec![r as u8; 64])) as Box<dyn Region>],
            );
            let link = Link::Reuse(Box::new(Staged(c, false)));
            let (res, back) = transfer_on(b, plan, r as u32, link, lent, Duration::from_secs(5));
            res.unwrap();
            assert!(back.is_none());
        });
    }

    #[test]
    fn a_rank_without_memory_for_its_flow_fails_clearly() {
        on_every_rank(
            2,
            |_| {},
            Duration::from_secs(5),
            |_, b, plan, mut c| {
                let e = run(b, &mut *c, plan, &mut Lent::new(Device::Cpu)).unwrap_err();
                assert!(e.to_string().contains("lent no memory"), "{e}");
            },
        );
    }
}
