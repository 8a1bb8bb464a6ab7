//! How a broadcast within a subset of a communicator's ranks goes over
//! NCCL's point-to-point calls: a pipelined chain of pieces (pure; the
//! calls are made by `nccl.rs`).
//!
//! `ncclBroadcast` needs every rank of the communicator. Within a subset
//! the root used to `ncclSend` the whole buffer to each member, so its
//! link carried N copies. Down a chain (the root, then the members in
//! rank order) each link carries the payload once, and pieces overlap: a
//! member forwards piece k while it receives piece k+1. A subset broadcast
//! of `len` bytes to `n` members then takes about `len/B + (n-1)·piece/B`
//! instead of `n·len/B` (bandwidth `B`).
//!
//! The chain runs in *steps*: one NCCL group per step and rank. At step
//! `s` the rank at position `p` of the chain receives piece `s - p + 1`
//! from the one before it and sends piece `s - p` to the one after it.
//! Within a step a pair of ranks only ever talks one way (NCCL sets up
//! point-to-point connections per group, and both sides of a pair must ask
//! for the same ones: see `transport::flow_handshake`), a piece is sent
//! only after the step that received it (the stream runs groups in order),
//! and the sends and receives of a pair match in order.
//!
//! Payloads under [`CHAIN_MIN`] go straight from the root to every member
//! in one group: latency, not bandwidth, is what counts for them.

/// Bytes of one piece of a chain.
pub(crate) const PIECE: u64 = 4 << 20;

/// Subset broadcasts of fewer bytes go straight from the root.
pub(crate) const CHAIN_MIN: u64 = 2 * PIECE;

/// Steps of a chain a rank posts ahead of what its GPU has run (see
/// `NcclComm::steps`): enough to keep the pipeline full (a step depends on
/// its neighbours' previous one only), few enough that a dead peer leaves
/// little queued behind a call that may not look at the abort flag.
pub(crate) const IN_FLIGHT: usize = 8;

/// Posts steps `0..n` in order, at most `window` ahead of the GPU: before
/// posting step `i`, waits (`wait(ctx, i - window)`) for step
/// `i - window` to have run. The first error stops it: nothing more is
/// posted.
pub(crate) fn post_bounded<C: ?Sized, E>(
    n: usize,
    window: usize,
    ctx: &mut C,
    mut wait: impl FnMut(&mut C, usize) -> Result<(), E>,
    mut post: impl FnMut(&mut C, usize) -> Result<(), E>,
) -> Result<(), E> {
    let window = window.max(1);
    for i in 0..n {
        if let Some(earlier) = i.checked_sub(window) {
            wait(ctx, earlier)?;
        }
        post(ctx, i)?;
    }
    Ok(())
}

/// One point-to-point operation of a step: byte offset (from the start of
/// the broadcast), bytes, peer rank.
pub(crate) type Op = (u64, u64, u32);

/// What one rank does in one NCCL group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Step {
    pub(crate) sends: Vec<Op>,
    pub(crate) recvs: Vec<Op>,
}

/// The steps of rank `me` in a broadcast of `len` bytes down `order` (the
/// root first, then each member once), `piece` bytes at a time; straight
/// from the root under `chain_min` bytes. Empty when `me` is not in
/// `order` or there is nothing to move.
pub(crate) fn steps(order: &[u32], me: u32, len: u64, piece: u64, chain_min: u64) -> Vec<Step> {
    let Some(pos) = order.iter().position(|r| *r == me) else {
        return Vec::new();
    };
    if len == 0 || order.len() < 2 {
        return Vec::new();
    }
    if len < chain_min {
        let step = if pos == 0 {
            Step {
                sends: order[1..].iter().map(|m| (0, len, *m)).collect(),
                recvs: Vec::new(),
            }
        } else {
            Step {
                sends: Vec::new(),
                recvs: vec![(0, len, order[0])],
            }
        };
        return vec![step];
    }
    let piece = piece.max(1);
    let pieces = len.div_ceil(piece) as i64;
    let at = |k: i64| -> Option<(u64, u64)> {
        (0..pieces).contains(&k).then(|| {
            let off = k as u64 * piece;
            (off, piece.min(len - off))
        })
    };
    let prev = pos.checked_sub(1).map(|i| order[i]);
    let next = order.get(pos + 1).copied();
    let p = pos as i64;
    let last_step = pieces + order.len() as i64 - 2;
    let mut out = Vec::new();
    for s in 0..=last_step {
        let mut step = Step::default();
        if let (Some(from), Some((off, n))) = (prev, at(s - p + 1)) {
            step.recvs.push((off, n, from));
        }
        if let (Some(to), Some((off, n))) = (next, at(s - p)) {
            step.sends.push((off, n, to));
        }
        if !step.sends.is_empty() || !step.recvs.is_empty() {
            out.push(step);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;

    /// Runs every rank's steps together, as NCCL would: operations between
    /// a pair match in order, a rank's group waits for its earlier groups,
    /// and a rank sends only bytes it has. Returns, per rank, the bytes it
    /// holds at the end and the bytes it sent.
    fn simulate(
        order: &[u32],
        len: u64,
        piece: u64,
        chain_min: u64,
    ) -> HashMap<u32, (Vec<bool>, u64)> {
        let root = order[0];
        let mut have: HashMap<u32, Vec<bool>> = order
            .iter()
            .map(|r| (*r, vec![*r == root; len as usize]))
            .collect();
        let mut sent: HashMap<u32, u64> = HashMap::new();
        let mut plans: HashMap<u32, std::collections::VecDeque<Step>> = order
            .iter()
            .map(|r| (*r, steps(order, *r, len, piece, chain_min).into()))
            .collect();
        // Messages in flight, per (from, to), in order: (offset, bytes).
        let mut wire: HashMap<(u32, u32), std::collections::VecDeque<(u64, u64)>> = HashMap::new();
        // A rank's current group: its sends are posted at once (what they
        // carry is read when posted, which the stream order makes safe:
        // the step that received those bytes ran before); it moves on once
        // every receive of the group has matched a message.
        let mut pending: HashMap<u32, Vec<Op>> = HashMap::new();
        loop {
            let mut progressed = false;
            for r in order {
                if pending.get(r).is_none_or(Vec::is_empty) {
                    let Some(step) = plans.get_mut(r).unwrap().pop_front() else {
                        continue;
                    };
                    let mut ways = HashSet::new();
                    for (off, n, to) in &step.sends {
                        assert!(
                            ways.insert((*r, *to)),
                            "rank {r} sends twice to {to} in a step"
                        );
                        let mine = &have[r][*off as usize..(off + n) as usize];
                        assert!(mine.iter().all(|b| *b), "rank {r} sends bytes it lacks");
                        wire.entry((*r, *to)).or_default().push_back((*off, *n));
                        *sent.entry(*r).or_default() += n;
                    }
                    for (_, _, from) in &step.recvs {
                        assert!(
                            !step.sends.iter().any(|(_, _, to)| to == from),
                            "rank {r} talks both ways with {from} in one step"
                        );
                    }
                    pending.insert(*r, step.recvs.clone());
                    progressed = true;
                }
                let recvs = pending.get_mut(r).unwrap();
                let mut still = Vec::new();
                for (off, n, from) in recvs.drain(..) {
                    match wire.get_mut(&(from, *r)).and_then(|q| q.pop_front()) {
                        Some(msg) => {
                            assert_eq!(msg, (off, n), "rank {r}: a receive matched another send");
                            have.get_mut(r).unwrap()[off as usize..(off + n) as usize].fill(true);
                            progressed = true;
                        }
                        None => still.push((off, n, from)),
                    }
                }
                *recvs = still;
            }
            if !progressed {
                break;
            }
        }
        assert!(wire.values().all(|q| q.is_empty()), "sends nobody received");
        assert!(
            pending.values().all(Vec::is_empty),
            "receives that never matched (a hang)"
        );
        order
            .iter()
            .map(|r| (*r, (have[r].clone(), sent.get(r).copied().unwrap_or(0))))
            .collect()
    }

    #[test]
    fn a_chain_delivers_every_byte_and_the_root_sends_it_once() {
        for (order, len, piece) in [
            (vec![0u32, 1, 3], 100u64, 7u64),
            (vec![2, 0, 1, 3, 5], 64, 16),
            (vec![4, 1], 33, 32),
            (vec![0, 1, 2, 3, 4, 5, 6, 7], 1000, 1),
        ] {
            let out = simulate(&order, len, piece, 2 * piece);
            for (r, (have, _)) in &out {
                assert!(
                    have.iter().all(|b| *b),
                    "{order:?} {len}: rank {r} lacks bytes"
                );
            }
            // Every link carries the payload once: the root's does not
            // carry one copy per member.
            let last = *order.last().unwrap();
            for r in &order {
                let want = if *r == last { 0 } else { len };
                assert_eq!(out[r].1, want, "{order:?}: rank {r} sent");
            }
        }
    }

    #[test]
    fn pieces_overlap_down_the_chain() {
        // 8 pieces down 4 ranks: 8 + 4 - 2 steps in all, not 8 · 3.
        let order = [0, 1, 2, 3];
        let middle = steps(&order, 1, 80, 10, 20);
        assert_eq!(middle.len(), 9);
        // A middle rank receives piece k+1 while it forwards piece k.
        assert_eq!(
            middle[1],
            Step {
                sends: vec![(0, 10, 2)],
                recvs: vec![(10, 10, 0)],
            }
        );
        let steps_total = (0..4)
            .map(|r| steps(&order, r, 80, 10, 20).len())
            .max()
            .unwrap();
        assert_eq!(steps_total, 9);
    }

    #[test]
    fn small_payloads_go_straight_from_the_root() {
        let order = [3, 0, 5];
        assert_eq!(
            steps(&order, 3, 10, 4, 11),
            vec![Step {
                sends: vec![(0, 10, 0), (0, 10, 5)],
                recvs: vec![],
            }]
        );
        assert_eq!(
            steps(&order, 5, 10, 4, 11),
            vec![Step {
                sends: vec![],
                recvs: vec![(0, 10, 3)],
            }]
        );
        let out = simulate(&order, 10, 4, 11);
        assert_eq!(out[&3].1, 20, "the root sends one copy per member");
        assert!(out[&5].0.iter().all(|b| *b));
    }

    /// A fake GPU running posted steps in order; a peer that dies after
    /// `dies_after` steps stops it there (what comes after never runs).
    struct Gpu {
        posted: usize,
        ran: usize,
        dies_after: usize,
        most_in_flight: usize,
    }

    impl Gpu {
        fn run(&mut self) {
            self.ran = self.posted.min(self.dies_after);
        }
    }

    /// The chain of a 4 GiB tensor is 1,024 steps: a rank never has more
    /// than [`IN_FLIGHT`] of them posted and not run, and a peer dying
    /// mid-broadcast stops the posting at the first wait that cannot be
    /// met (which fails at its deadline) instead of queueing the rest.
    #[test]
    fn a_chain_keeps_a_bounded_number_of_steps_in_flight() {
        let n = steps(&[0, 1, 2], 1, 4 << 30, PIECE, CHAIN_MIN).len();
        assert!(n >= 1024, "{n} steps");
        let mut gpu = Gpu {
            posted: 0,
            ran: 0,
            dies_after: usize::MAX,
            most_in_flight: 0,
        };
        let wait = |g: &mut Gpu, earlier: usize| -> Result<(), String> {
            g.run();
            if g.ran > earlier {
                Ok(())
            } else {
                Err(format!("step {earlier} never ran: deadline"))
            }
        };
        let post = |g: &mut Gpu, i: usize| -> Result<(), String> {
            assert_eq!(g.posted, i, "steps are posted in order");
            g.posted += 1;
            g.most_in_flight = g.most_in_flight.max(g.posted - g.ran);
            Ok(())
        };
        post_bounded(n, IN_FLIGHT, &mut gpu, wait, post).unwrap();
        assert_eq!(gpu.posted, n);
        assert_eq!(gpu.most_in_flight, IN_FLIGHT);
        let mut gpu = Gpu {
            posted: 0,
            ran: 0,
            dies_after: 100,
            most_in_flight: 0,
        };
        let e = post_bounded(n, IN_FLIGHT, &mut gpu, wait, post).unwrap_err();
        assert_eq!(e, "step 100 never ran: deadline");
        assert_eq!(
            gpu.posted,
            100 + IN_FLIGHT,
            "nothing posted past the window"
        );
    }

    #[test]
    fn outsiders_and_empty_payloads_have_nothing_to_do() {
        assert!(steps(&[0, 1], 2, 100, 10, 0).is_empty());
        assert!(steps(&[0, 1], 1, 0, 10, 0).is_empty());
        assert!(steps(&[0], 0, 100, 10, 0).is_empty());
    }
}
