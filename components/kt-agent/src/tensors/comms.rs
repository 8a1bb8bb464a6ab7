//! Communicators kept between the quorum transfers of a group, and between
//! the point-to-point sessions of two agents.
//!
//! Building an NCCL communicator takes 0.1 to several seconds, and a
//! reinforcement-learning loop moves the same members' weights every step.
//! So after a transfer that ran to its end, each rank keeps its
//! communicator ([`kt_tensor::transfer_on`] gives it back when it is
//! healthy), under the transfer's id, for its group and GPU. A later join
//! of the group lists (and reserves) what it keeps ([`QuorumJoin::comms`]);
//! the metadata server answers the id every rank listed for exactly the
//! plan's ranks ([`QuorumPlan::reuse`]), and the ranks run on it without a
//! rendezvous.
//!
//! - A reservation is a join's own: another join of the group cannot list
//!   the same communicator (one transfer at a time runs on one), and what
//!   the plan does not reuse is released when the join ends.
//! - A communicator whose transfer failed is never kept; one the plan
//!   named but this agent no longer has fails the transfer (every rank
//!   listed it, so that is a bug or a race with eviction, which skips
//!   reserved ones).
//! - Point-to-point sessions do the same between two agents (kept under
//!   [`pair`]): the getter offers what it keeps with the source
//!   ([`SessionRequest::comms`]), and the source answers one it keeps too
//!   ([`SessionReply::reuse`]).
//! - A group keeps one communicator per GPU (a newer one replaces it), and
//!   the agent at most [`DEFAULT_LIMIT`] in all: the least recently used
//!   goes. One that goes (or that a transfer took and then did not use) is
//!   retired on a blocking thread through its backend
//!   ([`kt_tensor::Backend::retire`]: closed once no transfer runs on the
//!   GPU, as NCCL frees device memory).

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kt_tensor::Comm;
use kt_types::tensor::{Device, HeldComm, MAX_HELD_COMMS, TransferPlan};
#[cfg(doc)]
use kt_types::tensor::{QuorumJoin, QuorumPlan, SessionReply, SessionRequest};

use super::locked;

/// The key point-to-point sessions with agent `peer` keep their
/// communicators under (a space never appears in a quorum group id).
pub fn pair(peer: &str) -> String {
    format!("p2p {peer}")
}

/// Communicators an agent keeps at most (each holds NCCL buffers on its
/// GPU).
pub const DEFAULT_LIMIT: usize = 4;

struct Entry {
    group: String,
    device: Device,
    held: HeldComm,
    comm: Box<dyn Comm>,
    /// The join sequence that reserved it, if one did.
    reserved: Option<u64>,
    used: Instant,
}

/// The kept communicators.
pub struct Comms {
    entries: Mutex<Vec<Entry>>,
    next: Mutex<u64>,
    limit: usize,
    /// Ids of communicators a running transfer will hand back (the
    /// transfer's own id), and a wake-up when one settles.
    pending: Mutex<HashSet<String>>,
    settled: tokio::sync::Notify,
}

impl std::fmt::Debug for Comms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kept: Vec<(String, String, Option<u64>)> = locked(&self.entries)
            .iter()
            .map(|e| (e.group.clone(), e.held.id.clone(), e.reserved))
            .collect();
        f.debug_struct("Comms").field("kept", &kept).finish()
    }
}

/// What one join reserved: released on drop, except what was taken.
pub struct Reservation<'a> {
    comms: &'a Comms,
    seq: u64,
    /// What the join lists.
    pub held: Vec<HeldComm>,
}

impl Reservation<'_> {
    /// Takes the reserved communicator `id` out of the cache.
    pub fn take(&self, id: &str) -> Option<Box<dyn Comm>> {
        let mut entries = locked(&self.comms.entries);
        let i = entries
            .iter()
            .position(|e| e.reserved == Some(self.seq) && e.held.id == id)?;
        Some(entries.swap_remove(i).comm)
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        for e in locked(&self.comms.entries).iter_mut() {
            if e.reserved == Some(self.seq) {
                e.reserved = None;
            }
        }
    }
}

impl Comms {
    pub fn new(limit: usize) -> Comms {
        Comms {
            entries: Mutex::default(),
            next: Mutex::new(0),
            limit: limit.max(1),
            pending: Mutex::default(),
            settled: tokio::sync::Notify::new(),
        }
    }

    /// A transfer of id `id` runs: what it may keep is on its way
    /// (a point-to-point source's side ends a little after its getter's,
    /// whose next session may offer that communicator already).
    pub fn expect(&self, id: &str) {
        locked(&self.pending).insert(id.to_owned());
    }

    /// The transfer of id `id` ended (what it kept, if anything, is kept).
    pub fn settle(&self, id: &str) {
        locked(&self.pending).remove(id);
        self.settled.notify_waiters();
    }

    /// Waits up to `limit` for the transfers of `ids` still running to
    /// end.
    pub async fn settled(&self, ids: &[&str], limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let woken = self.settled.notified();
            if !ids.iter().any(|id| locked(&self.pending).contains(*id)) {
                return;
            }
            if tokio::time::timeout_at(deadline, woken).await.is_err() {
                return;
            }
        }
    }

    /// Reserves what `group` keeps idle on `device` for one join.
    pub fn reserve(&self, group: &str, device: Device) -> Reservation<'_> {
        let seq = {
            let mut n = locked(&self.next);
            *n += 1;
            *n
        };
        let mut held = Vec::new();
        for e in locked(&self.entries).iter_mut() {
            if e.group == group
                && e.device == device
                && e.reserved.is_none()
                && held.len() < MAX_HELD_COMMS
            {
                e.reserved = Some(seq);
                held.push(e.held.clone());
            }
        }
        Reservation {
            comms: self,
            seq,
            held,
        }
    }

    /// Keeps `comm`, the communicator of `plan` (whose ranks it serves),
    /// for `group` on `device`: it replaces what the group kept there, and
    /// the least recently used beyond the limit goes. Returns those that
    /// went, with their devices, for [`kt_tensor::Backend::retire`]
    /// (closing one waits for NCCL and frees device memory).
    #[must_use = "communicators that went must be retired"]
    pub fn keep(
        &self,
        group: &str,
        device: Device,
        plan: &TransferPlan,
        comm: Box<dyn Comm>,
    ) -> Vec<(Device, Box<dyn Comm>)> {
        let held = HeldComm {
            id: plan.id.clone(),
            members: plan.ranks.iter().map(|r| r.agent.clone()).collect(),
        };
        let dropped = {
            let mut entries = locked(&self.entries);
            let (mut gone, kept): (Vec<Entry>, Vec<Entry>) = std::mem::take(&mut *entries)
                .into_iter()
                .partition(|e| e.group == group && e.device == device && e.reserved.is_none());
            *entries = kept;
            entries.push(Entry {
                group: group.to_owned(),
                device,
                held,
                comm,
                reserved: None,
                used: Instant::now(),
            });
            while entries.len() > self.limit {
                let oldest = entries
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| e.reserved.is_none())
                    .min_by_key(|(_, e)| e.used)
                    .map(|(i, _)| i);
                match oldest {
                    Some(i) => gone.push(entries.swap_remove(i)),
                    None => break,
                }
            }
            gone
        };
        dropped.into_iter().map(|e| (e.device, e.comm)).collect()
    }

    /// The ids kept, for `group`.
    #[cfg(test)]
    pub fn kept(&self, group: &str) -> Vec<String> {
        locked(&self.entries)
            .iter()
            .filter(|e| e.group == group)
            .map(|e| e.held.id.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use kt_tensor::Region;
    use kt_tensor::testing::FakeComm;
    use kt_types::tensor::{BackendKind, Packing, Rank};

    use super::*;

    /// A communicator that counts its drops (closes) in `drops`.
    fn counted(drops: &Arc<AtomicUsize>) -> Box<dyn Comm> {
        Box::new(FakeComm::counting_drops(drops))
    }

    fn plan(id: &str) -> TransferPlan {
        TransferPlan {
            id: id.into(),
            backend: BackendKind::Nccl,
            ranks: ["a", "b"]
                .iter()
                .enumerate()
                .map(|(i, a)| Rank {
                    rank: i as u32,
                    agent: (*a).into(),
                    member: String::new(),
                    node: String::new(),
                    ip: "10.0.0.1".into(),
                    endpoint: "10.0.0.1".into(),
                })
                .collect(),
            flows: vec![],
            packing: Packing::default(),
            fanout: 1,
        }
    }

    #[test]
    fn a_join_reserves_what_its_group_keeps_and_releases_what_it_does_not_take() {
        let drops = Arc::new(AtomicUsize::new(0));
        let comms = Comms::new(4);
        let gpu = Device::Cuda(0);
        drop(comms.keep("g", gpu, &plan("t1"), counted(&drops)));
        // Another group, another GPU: not listed.
        drop(comms.keep("h", gpu, &plan("t2"), counted(&drops)));
        drop(comms.keep("g", Device::Cuda(1), &plan("t3"), counted(&drops)));
        let r = comms.reserve("g", gpu);
        assert_eq!(r.held.len(), 1);
        assert_eq!(r.held[0].id, "t1");
        assert_eq!(r.held[0].members, ["a", "b"]);
        // A second join of the group meanwhile gets nothing: one transfer
        // at a time on a communicator.
        assert!(comms.reserve("g", gpu).held.is_empty());
        assert!(r.take("t2").is_none(), "not reserved by this join");
        drop(r);
        let r = comms.reserve("g", gpu);
        let c = r.take("t1").expect("reserved");
        assert_eq!(comms.kept("g"), ["t3"]);
        drop(r);
        drop(c);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    /// A session offering the communicator of a transfer still ending on
    /// this side waits for it (bounded), then finds it kept.
    #[tokio::test]
    async fn a_session_waits_for_the_transfer_that_will_keep_its_communicator() {
        let drops = Arc::new(AtomicUsize::new(0));
        let comms = Arc::new(Comms::new(4));
        let gpu = Device::Cuda(0);
        comms.expect("t1");
        let c = comms.clone();
        let d = drops.clone();
        let ending = tokio::spawn(async move {
            tokio::task::yield_now().await;
            drop(c.keep("p2p a", gpu, &plan("t1"), counted(&d)));
            c.settle("t1");
        });
        comms.settled(&["t1"], Duration::from_secs(10)).await;
        assert_eq!(comms.reserve("p2p a", gpu).held.len(), 1);
        ending.await.unwrap();
        // Nothing pending, or a transfer that never settles: no wait past
        // the limit.
        comms.settled(&["t1"], Duration::from_secs(10)).await;
        comms.expect("t9");
        let t = Instant::now();
        comms.settled(&["t9"], Duration::from_millis(50)).await;
        assert!(t.elapsed() >= Duration::from_millis(50));
    }

    /// Memory an application lent, mapped on the agent's GPU `n`.
    #[derive(Debug)]
    struct OnGpu(u32);

    impl Region for OnGpu {
        fn len(&self) -> u64 {
            0
        }
        fn device(&self) -> Device {
            Device::Cuda(self.0)
        }
        fn host(&self) -> Option<&[u8]> {
            None
        }
        fn host_mut(&mut self) -> Option<&mut [u8]> {
            None
        }
        fn device_ptr(&self) -> Option<u64> {
            Some(0)
        }
    }

    /// Two processes of a pod each see their GPU as `cuda:0` (one
    /// `CUDA_VISIBLE_DEVICES` each): their gets name the same device, but
    /// the memory is on the agent's GPUs 0 and 1, where the communicators
    /// are built. Point-to-point sessions key what they keep by that
    /// (`Lent::memory_device`), so neither is offered the other's.
    #[test]
    fn processes_numbering_their_gpus_alike_keep_their_own_communicators() {
        use kt_tensor::engine::Lent;

        let drops = Arc::new(AtomicUsize::new(0));
        let comms = Comms::new(4);
        let lent = |gpu: u32| {
            let mut l = Lent::new(Device::Cuda(0));
            l.keys.insert(
                kt_types::Key::parse("m/w").unwrap(),
                vec![Box::new(OnGpu(gpu)) as Box<dyn Region>],
            );
            l
        };
        let (a, b) = (lent(0), lent(1));
        assert_eq!(a.device, b.device, "the same number in both processes");
        let pair = pair("source");
        drop(comms.keep(&pair, a.memory_device(), &plan("of-a"), counted(&drops)));
        let r = comms.reserve(&pair, b.memory_device());
        assert!(r.held.is_empty(), "b was offered a's communicator");
        drop(r);
        let r = comms.reserve(&pair, a.memory_device());
        assert_eq!(r.held.len(), 1);
    }

    #[test]
    fn a_newer_communicator_replaces_the_groups_and_the_oldest_goes_beyond_the_limit() {
        let drops = Arc::new(AtomicUsize::new(0));
        let comms = Comms::new(2);
        let gpu = Device::Cuda(0);
        assert!(
            comms
                .keep("g", gpu, &plan("t1"), counted(&drops))
                .is_empty()
        );
        // What went is handed back to be retired (not closed under the lock).
        let gone = comms.keep("g", gpu, &plan("t2"), counted(&drops));
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].0, gpu);
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(gone);
        assert_eq!(comms.kept("g"), ["t2"]);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        // A reserved one is neither replaced nor evicted.
        let r = comms.reserve("g", gpu);
        drop(comms.keep("g", gpu, &plan("t3"), counted(&drops)));
        drop(comms.keep("h", gpu, &plan("t4"), counted(&drops)));
        assert_eq!(
            drops.load(Ordering::SeqCst),
            2,
            "t3, the oldest idle one, went"
        );
        let mut kept = comms.kept("g");
        kept.extend(comms.kept("h"));
        assert_eq!(kept, ["t2", "t4"]);
        drop(r);
    }
}
