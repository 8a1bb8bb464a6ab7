//! One transfer at a time per device, for transports that need it.
//!
//! NCCL's kernels wait for their peers, and a CUDA call that synchronises
//! the device (`cuMemFree`, `cuIpcCloseMemHandle`, a communicator's
//! destruction) waits for every kernel on it: two transfers on one GPU can
//! stall each other behind peers that wait for them in turn. NCCL's advice
//! is to run communicators one at a time per device, so the NCCL backend
//! holds a transfer's device from before `connect` until its communicator
//! is gone ([`crate::engine::transfer`]), and what would synchronise the
//! device while it is held (closing an IPC mapping the owner released) is
//! put off until the holder lets go.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::transport::TransportError;

/// Which devices are held, and what waits for them to be let go.
#[derive(Default)]
pub struct DeviceHolds {
    state: Mutex<State>,
    released: Condvar,
}

#[derive(Default)]
struct State {
    held: HashSet<u32>,
    deferred: HashMap<u32, Vec<Box<dyn Send>>>,
}

impl std::fmt::Debug for DeviceHolds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("DeviceHolds")
            .field("held", &s.held)
            .field(
                "deferred",
                &s.deferred.values().map(Vec::len).sum::<usize>(),
            )
            .finish()
    }
}

impl DeviceHolds {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds device `ordinal` (named `name` in errors), waiting up to
    /// `timeout` for the transfer holding it now.
    pub fn hold(
        self: &Arc<Self>,
        ordinal: u32,
        name: &str,
        timeout: Duration,
    ) -> Result<Held, TransportError> {
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        while s.held.contains(&ordinal) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::Timeout(format!(
                    "{name} was busy with another transfer for {timeout:?} (transfers on one GPU run one at a time)"
                )));
            }
            s = self
                .released
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        s.held.insert(ordinal);
        Ok(Held {
            holds: self.clone(),
            ordinal,
        })
    }

    /// Drops `item` now, or when the transfer holding `ordinal` lets go.
    pub fn defer(&self, ordinal: u32, item: Box<dyn Send>) {
        let mut s = self.lock();
        if s.held.contains(&ordinal) {
            s.deferred.entry(ordinal).or_default().push(item);
        } else {
            drop(s);
            drop(item);
        }
    }

    pub fn is_held(&self, ordinal: u32) -> bool {
        self.lock().held.contains(&ordinal)
    }
}

/// A held device: let go on drop, after what was deferred is dropped.
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
            let items = s.deferred.remove(&self.ordinal).unwrap_or_default();
            if items.is_empty() {
                s.held.remove(&self.ordinal);
                break;
            }
            // Still held while they are dropped: nothing else runs on the
            // device, so what they synchronise waits for nobody.
            drop(s);
            drop(items);
        }
        self.holds.released.notify_all();
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

    #[test]
    fn a_held_device_waits_for_its_holder_and_others_do_not() {
        let holds = Arc::new(DeviceHolds::default());
        let first = holds.hold(0, "cuda:0", Duration::ZERO).unwrap();
        // Another device is free.
        let other = holds.hold(1, "cuda:1", Duration::ZERO).unwrap();
        let e = holds
            .hold(0, "cuda:0", Duration::from_millis(50))
            .unwrap_err();
        assert!(
            matches!(&e, TransportError::Timeout(m) if m.contains("cuda:0 was busy with another transfer")),
            "{e}"
        );
        let waiter = {
            let holds = holds.clone();
            std::thread::spawn(move || holds.hold(0, "cuda:0", Duration::from_secs(30)).map(drop))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished(), "took a held device");
        drop(first);
        waiter.join().unwrap().unwrap();
        drop(other);
        assert!(!holds.is_held(0) && !holds.is_held(1));
    }

    #[test]
    fn what_is_deferred_is_dropped_when_the_holder_lets_go() {
        let holds = Arc::new(DeviceHolds::default());
        let (a, b) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        // Not held: at once.
        holds.defer(0, Box::new(Flag(a.clone())));
        assert!(a.load(Ordering::SeqCst));
        let held = holds.hold(0, "cuda:0", Duration::ZERO).unwrap();
        holds.defer(0, Box::new(Flag(b.clone())));
        assert!(
            !b.load(Ordering::SeqCst),
            "dropped while the device was held"
        );
        drop(held);
        assert!(b.load(Ordering::SeqCst));
        holds.hold(0, "cuda:0", Duration::ZERO).unwrap();
    }
}
