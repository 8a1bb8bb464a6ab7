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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Per device: how many transfers run, and what waits for none to.
#[derive(Default)]
pub struct DeviceHolds {
    state: Mutex<HashMap<u32, Device>>,
}

#[derive(Default)]
struct Device {
    holders: usize,
    deferred: Vec<Box<dyn Send>>,
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

    /// Holds device `ordinal` for one transfer (never waits).
    pub fn hold(self: &Arc<Self>, ordinal: u32) -> Held {
        self.lock().entry(ordinal).or_default().holders += 1;
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
                return;
            }
            // The last holder: still counted while the deferred items are
            // dropped (what they free waits for no other transfer), and
            // again for what was deferred meanwhile.
            let items = std::mem::take(&mut d.deferred);
            drop(s);
            drop(items);
        }
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

    #[test]
    fn a_holder_that_never_lets_go_keeps_what_was_deferred() {
        // A wedged transfer (an abort that did not return) forgets its hold:
        // nothing deferred on its device is ever freed under it.
        let holds = Arc::new(DeviceHolds::default());
        std::mem::forget(holds.hold(0));
        let (c, item) = flag();
        holds.defer(0, item);
        drop(holds.hold(0));
        assert!(!c.load(Ordering::SeqCst));
    }
}
