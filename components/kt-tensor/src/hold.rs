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
//! communicators (bounded by their timeout, then aborted).
//!
//! A transfer whose communicator is wedged (an abort that has not returned)
//! hands its hold and memory to a [`Reaper`], which drops them once the
//! abort returns: the device is held, and what was deferred kept, only
//! until then.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

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
    deferred: Vec<Box<dyn Send>>,
    /// The last holder is dropping what was deferred: new holds wait.
    draining: bool,
    /// Holds waiting for the drain to end.
    waiting: usize,
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
    /// holder is dropping what was deferred (then once it is done).
    pub fn hold(self: &Arc<Self>, ordinal: u32) -> Held {
        let mut s = self.lock();
        loop {
            let d = s.entry(ordinal).or_default();
            if !d.draining {
                d.holders += 1;
                break;
            }
            d.waiting += 1;
            s = self.drained.wait(s).unwrap_or_else(|e| e.into_inner());
            s.entry(ordinal).or_default().waiting -= 1;
        }
        drop(s);
        Held {
            holds: self.clone(),
            ordinal,
        }
    }

    /// Drops `item` now, or when the last transfer holding `ordinal` lets
    /// go.
    pub fn defer(&self, ordinal: u32, item: Box<dyn Send>) {
        let mut s = self.lock();
        match s.get_mut(&ordinal) {
            Some(d) if d.holders > 0 => d.deferred.push(item),
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
                if d.draining {
                    // The drain this holder ran is over.
                    d.draining = false;
                    drop(s);
                    self.holds.drained.notify_all();
                }
                return;
            }
            // The last holder: still counted while the deferred items are
            // dropped, and again for what was deferred meanwhile; no new
            // transfer starts on the device until it is done (what they
            // free waits for no transfer then).
            d.draining = true;
            let items = std::mem::take(&mut d.deferred);
            drop(s);
            drop(items);
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
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    struct Flag(Arc<AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn flag() -> (Arc<AtomicBool>, Box<dyn Send>) {
        let f = Arc::new(AtomicBool::new(false));
        (f.clone(), Box::new(Flag(f)))
    }

    #[test]
    fn holds_are_shared_and_what_is_deferred_waits_for_the_last_holder() {
        let holds = Arc::new(DeviceHolds::default());
        // Not held: at once.
        let (a, item) = flag();
        holds.defer(0, item);
        assert!(a.load(Ordering::SeqCst));
        let first = holds.hold(0);
        let second = holds.hold(0);
        let other = holds.hold(1);
        assert_eq!((holds.holders(0), holds.holders(1)), (2, 1));
        let (b, item) = flag();
        holds.defer(0, item);
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
        use std::sync::mpsc::channel;
        use std::time::{Duration, Instant};

        struct Slow {
            started: std::sync::mpsc::Sender<()>,
            go: std::sync::mpsc::Receiver<()>,
        }
        impl Drop for Slow {
            fn drop(&mut self) {
                let _ = self.started.send(());
                let _ = self.go.recv();
            }
        }
        let holds = Arc::new(DeviceHolds::default());
        let (started_tx, started) = channel();
        let (go, go_rx) = channel();
        let first = holds.hold(0);
        holds.defer(
            0,
            Box::new(Slow {
                started: started_tx,
                go: go_rx,
            }),
        );
        let draining = std::thread::spawn(move || drop(first));
        started.recv().unwrap();
        // The drain runs: a new transfer asks for the device.
        let (held_tx, held) = channel();
        let h = holds.clone();
        let newcomer = std::thread::spawn(move || {
            let g = h.hold(0);
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

    #[test]
    fn a_reaped_hold_keeps_what_was_deferred_until_the_call_returns() {
        // A wedged transfer (an abort that did not return) hands its hold
        // to a reaper: nothing deferred on its device is freed under its
        // kernels, and everything is once the abort returns.
        let holds = Arc::new(DeviceHolds::default());
        let reaper = Reaper::default();
        reaper.after(Box::new(holds.hold(0)));
        let (c, item) = flag();
        holds.defer(0, item);
        drop(holds.hold(0));
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
