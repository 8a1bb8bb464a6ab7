//! What must wait until no transfer runs on a device.
//!
//! NCCL's kernels wait for their peers, and a CUDA call that synchronises
//! the device (`cuMemFree`, `cuIpcCloseMemHandle`) waits for every kernel
//! on it: a transfer that frees memory while another transfer's kernels
//! wait for remote peers stalls behind them, and chains of such waits
//! across agents can stall for good. So every transfer holds its device
//! while it runs ([`crate::engine::transfer`]) and what would synchronise
//! the device (a staging buffer's free, the close of an IPC mapping) is
//! put off until the last holder lets go.
//!
//! Holds are shared: transfers on one device run side by side (an
//! exclusive hold would make transfers that need each other in opposite
//! orders on two agents wait out their timeouts, and queue every getter of
//! one source behind the others).
//!
//! The last holder drops what was deferred while it still counts, and the
//! device is *draining* meanwhile: a new hold waits until the drain is over
//! (a transfer that started then would queue NCCL kernels, waiting on
//! remote peers, that the free synchronises behind; two agents doing this
//! to each other would unstick only at their deadlines). The drain waits
//! for nothing remote: frees, IPC closes, and the close of retired
//! communicators (bounded by their timeout, then aborted). A new hold
//! waits for it at most its transfer's timeout: a drain that lasts longer
//! is stuck in the driver or NCCL, and the hold fails naming what it is
//! stuck on and what to do, instead of every later transfer on the device
//! waiting for good.
//!
//! A transfer whose communicator is wedged (an abort that has not returned)
//! hands its hold and memory to a [`Reaper`], which drops them once the
//! abort returns: the device is held, and what was deferred kept, only
//! until then.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::transport::TransportError;

/// Per device: how many transfers run, and what waits for none to.
#[derive(Default)]
pub struct DeviceHolds {
    state: Mutex<HashMap<u32, Device>>,
    /// Woken when a device's drain ends.
    drained: Condvar,
}

#[derive(Default)]
struct Device {
    holders: usize,
    /// What waits for no transfer to run, and what each one is.
    deferred: Vec<(&'static str, Box<dyn Send>)>,
    /// The last holder is dropping what was deferred (since when, and
    /// what it drops now, of how many): new holds wait.
    draining: Option<Drain>,
    /// Holds waiting for the drain to end.
    waiting: usize,
}

struct Drain {
    since: Instant,
    now: &'static str,
    left: usize,
}

impl std::fmt::Debug for DeviceHolds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        let held: HashMap<u32, (usize, usize)> = s
            .iter()
            .map(|(d, v)| (*d, (v.holders, v.deferred.len())))
            .collect();
        f.debug_struct("DeviceHolds").field("held", &held).finish()
    }
}

impl DeviceHolds {
    fn lock(&self) -> MutexGuard<'_, HashMap<u32, Device>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds device `ordinal` for one transfer: at once, unless the last
    /// holder is dropping what was deferred (then once it is done). A drain
    /// that lasts longer than `wait` (a free or a communicator's close that
    /// does not return: a wedged GPU or NCCL) fails the hold, saying what
    /// is stuck, rather than the transfer waiting for good.
    pub fn hold(self: &Arc<Self>, ordinal: u32, wait: Duration) -> Result<Held, TransportError> {
        let deadline = Instant::now() + wait;
        let mut s = self.lock();
        loop {
            let d = s.entry(ordinal).or_default();
            let Some(drain) = &d.draining else {
                d.holders += 1;
                break;
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::Timeout(format!(
                    "cuda:{ordinal} has been freeing what its last transfer left for {}s (this transfer waited {}s to start): \
                     {} has not returned ({} of the drain's items left); a free or close that does not return means the GPU \
                     or NCCL is wedged: look for Xid errors in the node's kernel log (dmesg) and at nvidia-smi, and restart \
                     the agent's pod if later transfers on this GPU fail the same way",
                    drain.since.elapsed().as_secs(),
                    wait.as_secs(),
                    drain.now,
                    drain.left,
                )));
            }
            d.waiting += 1;
            s = self
                .drained
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            s.entry(ordinal).or_default().waiting -= 1;
        }
        drop(s);
        Ok(Held {
            holds: self.clone(),
            ordinal,
        })
    }

    /// Drops `item` now, or when the last transfer holding `ordinal` lets
    /// go; `what` names it (e.g. "a staging buffer's cuMemFree") in the
    /// error of a hold that waited too long for it.
    pub fn defer(&self, ordinal: u32, what: &'static str, item: Box<dyn Send>) {
        let mut s = self.lock();
        match s.get_mut(&ordinal) {
            Some(d) if d.holders > 0 => d.deferred.push((what, item)),
            _ => {
                drop(s);
                drop(item);
            }
        }
    }

    /// Holds of `ordinal` waiting for a drain to end.
    pub fn waiting(&self, ordinal: u32) -> usize {
        self.lock().get(&ordinal).map_or(0, |d| d.waiting)
    }

    /// Transfers holding `ordinal` now.
    pub fn holders(&self, ordinal: u32) -> usize {
        self.lock().get(&ordinal).map_or(0, |d| d.holders)
    }
}

/// A held device: let go on drop; the last holder drops what was deferred.
pub struct Held {
    holds: Arc<DeviceHolds>,
    ordinal: u32,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        loop {
            let mut s = self.holds.lock();
            let d = s.entry(self.ordinal).or_default();
            if d.holders > 1 || d.deferred.is_empty() {
                d.holders -= 1;
                if d.draining.take().is_some() {
                    // The drain this holder ran is over.
                    drop(s);
                    self.holds.drained.notify_all();
                }
                return;
            }
            // The last holder: still counted while the deferred items are
            // dropped, and again for what was deferred meanwhile; no new
            // transfer starts on the device until it is done (what they
            // free waits for no transfer then).
            let items = std::mem::take(&mut d.deferred);
            let since = d.draining.as_ref().map_or_else(Instant::now, |g| g.since);
            d.draining = Some(Drain {
                since,
                now: items.first().map_or("", |(what, _)| *what),
                left: items.len(),
            });
            drop(s);
            let mut left = items.len();
            for (what, item) in items {
                if let Some(g) = self
                    .holds
                    .lock()
                    .get_mut(&self.ordinal)
                    .and_then(|d| d.draining.as_mut())
                {
                    (g.now, g.left) = (what, left);
                }
                drop(item);
                left -= 1;
            }
        }
    }
}

/// Drops what must outlive a call that was left running on its own thread
/// (an NCCL abort that did not return in time) once that call returns:
/// the memory its kernels may still touch and the device hold that keeps
/// frees off the device until then. Clones share the state.
#[derive(Clone, Default)]
pub struct Reaper {
    state: Arc<Mutex<Reaping>>,
}

#[derive(Default)]
struct Reaping {
    returned: bool,
    pending: Vec<Box<dyn Send>>,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("Reaper")
            .field("returned", &s.returned)
            .field("pending", &s.pending.len())
            .finish()
    }
}

impl Reaper {
    fn lock(&self) -> MutexGuard<'_, Reaping> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops `item` once the call has returned (now, if it has).
    pub fn after(&self, item: Box<dyn Send>) {
        let mut s = self.lock();
        if s.returned {
            drop(s);
            drop(item);
        } else {
            s.pending.push(item);
        }
    }

    /// The call returned: drops what waited for it, in the order it came.
    pub fn returned(&self) {
        let items = {
            let mut s = self.lock();
            s.returned = true;
            std::mem::take(&mut s.pending)
        };
        drop(items);
    }

    /// Whether the call has returned.
    pub fn has_returned(&self) -> bool {
        self.lock().returned
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc::{Receiver, Sender, channel};
    use std::thread::JoinHandle;

    use super::*;

    /// Long enough for any wait these tests expect to end.
    const WAIT: Duration = Duration::from_secs(60);

    struct Flag(Arc<AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// An item that says when it is dropped.
    pub(crate) fn flag() -> (Arc<AtomicBool>, Box<dyn Send>) {
        let f = Arc::new(AtomicBool::new(false));
        (f.clone(), Box::new(Flag(f)))
    }

    /// A free that does not return until told to (a driver call stuck
    /// behind a wedged kernel).
    struct Stuck {
        started: Sender<()>,
        go: Receiver<()>,
    }

    impl Drop for Stuck {
        fn drop(&mut self) {
            let _ = self.started.send(());
            let _ = self.go.recv();
        }
    }

    /// Device `ordinal` of `holds` draining, its last holder stuck freeing
    /// `what`: the drain ends when the sender given back sends (or is
    /// dropped); the thread that ran the transfer ends with it.
    pub(crate) fn stuck_drain(
        holds: &Arc<DeviceHolds>,
        ordinal: u32,
        what: &'static str,
    ) -> (Sender<()>, JoinHandle<()>) {
        let (started_tx, started) = channel();
        let (go, go_rx) = channel();
        let last = holds.hold(ordinal, WAIT).unwrap();
        let item = Stuck {
            started: started_tx,
            go: go_rx,
        };
        holds.defer(ordinal, what, Box::new(item));
        let draining = std::thread::spawn(move || drop(last));
        started.recv().unwrap();
        (go, draining)
    }

    #[test]
    fn holds_are_shared_and_what_is_deferred_waits_for_the_last_holder() {
        let holds = Arc::new(DeviceHolds::default());
        // Not held: at once.
        let (a, item) = flag();
        holds.defer(0, "a test's flag", item);
        assert!(a.load(Ordering::SeqCst));
        let first = holds.hold(0, WAIT).unwrap();
        let second = holds.hold(0, WAIT).unwrap();
        let other = holds.hold(1, WAIT).unwrap();
        assert_eq!((holds.holders(0), holds.holders(1)), (2, 1));
        let (b, item) = flag();
        holds.defer(0, "a test's flag", item);
        drop(other);
        drop(first);
        assert!(!b.load(Ordering::SeqCst), "dropped while a transfer ran");
        drop(second);
        assert!(b.load(Ordering::SeqCst));
        assert_eq!(holds.holders(0), 0);
    }

    /// What the last holder frees synchronises the device: a transfer
    /// starting meanwhile would queue NCCL kernels (waiting on remote
    /// peers) that the free then waits behind. So a new hold waits for the
    /// drain.
    #[test]
    fn a_new_hold_waits_while_the_last_holder_frees() {
        let holds = Arc::new(DeviceHolds::default());
        let (go, draining) = stuck_drain(&holds, 0, "a test's slow free");
        // The drain runs: a new transfer asks for the device.
        let (held_tx, held) = channel();
        let h = holds.clone();
        let newcomer = std::thread::spawn(move || {
            let g = h.hold(0, WAIT).unwrap();
            let _ = held_tx.send(());
            drop(g);
        });
        // Wait until the newcomer either holds the device or waits for it.
        let deadline = Instant::now() + Duration::from_secs(30);
        let started_meanwhile = loop {
            if holds.waiting(0) > 0 {
                break false;
            }
            if held.try_recv().is_ok() {
                break true;
            }
            assert!(Instant::now() < deadline, "the newcomer never asked");
            std::thread::yield_now();
        };
        assert!(
            !started_meanwhile,
            "a transfer started while the last holder was freeing"
        );
        go.send(()).unwrap();
        held.recv_timeout(Duration::from_secs(30))
            .expect("the newcomer holds the device once the drain is over");
        draining.join().unwrap();
        newcomer.join().unwrap();
        assert_eq!((holds.holders(0), holds.waiting(0)), (0, 0));
    }

    /// A drain that does not end (a free stuck in the driver) used to keep
    /// every later transfer on the device waiting for good; a hold now
    /// waits at most what it is given (its transfer's timeout) and fails
    /// naming the device, what is stuck, and what to do.
    #[test]
    fn a_hold_behind_a_drain_that_does_not_end_fails_saying_what_is_stuck() {
        let holds = Arc::new(DeviceHolds::default());
        let (go, draining) = stuck_drain(&holds, 3, "the cuMemFree of a staging buffer");
        let (tx, rx) = channel();
        let h = holds.clone();
        std::thread::spawn(move || {
            let _ = tx.send(h.hold(3, Duration::from_millis(200)).map(drop));
        });
        let e = rx
            .recv_timeout(WAIT)
            .expect("a hold behind a drain that does not end returns")
            .expect_err("the device is still draining");
        assert!(matches!(e, TransportError::Timeout(_)), "{e:?}");
        let msg = e.to_string();
        for want in [
            "cuda:3 has been freeing what its last transfer left",
            "the cuMemFree of a staging buffer has not returned (1 of the drain's items left)",
            "Xid",
            "restart the agent's pod",
        ] {
            assert!(msg.contains(want), "{want:?} not in: {msg}");
        }
        assert_eq!(holds.waiting(3), 0, "the failed hold no longer waits");
        // Other devices are not held up.
        drop(holds.hold(0, Duration::ZERO).unwrap());
        // Once the free returns, the device is held at once again.
        go.send(()).unwrap();
        draining.join().unwrap();
        drop(holds.hold(3, Duration::ZERO).unwrap());
        assert_eq!(holds.holders(3), 0);
    }

    #[test]
    fn a_reaped_hold_keeps_what_was_deferred_until_the_call_returns() {
        // A wedged transfer (an abort that did not return) hands its hold
        // to a reaper: nothing deferred on its device is freed under its
        // kernels, and everything is once the abort returns.
        let holds = Arc::new(DeviceHolds::default());
        let reaper = Reaper::default();
        reaper.after(Box::new(holds.hold(0, WAIT).unwrap()));
        let (c, item) = flag();
        holds.defer(0, "a test's flag", item);
        drop(holds.hold(0, WAIT).unwrap());
        assert!(!c.load(Ordering::SeqCst));
        assert!(!reaper.has_returned());
        reaper.returned();
        assert!(c.load(Ordering::SeqCst));
        assert_eq!(holds.holders(0), 0);
        // After the return, at once.
        let (d, item) = flag();
        reaper.after(item);
        assert!(d.load(Ordering::SeqCst));
    }
}
