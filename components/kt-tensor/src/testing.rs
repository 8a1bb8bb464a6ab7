//! Test doubles shared by this crate's tests and its users' (the agent's
//! communicator cache): compiled for tests and with the `testing` feature
//! only, never in a release build.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::hold::Reaper;
use crate::transport::{Comm, Region, TransportError};

/// Rank 0 of 2, moving nothing: its broadcasts succeed at once, or (when
/// [`FakeComm::wedged`]) fail as an aborted communicator's do and keep
/// what they are handed until the abort "returns". Counts its drops when
/// asked to ([`FakeComm::counting_drops`]).
#[derive(Debug, Default)]
pub struct FakeComm {
    drops: Option<Arc<AtomicUsize>>,
    reaper: Option<Reaper>,
}

impl FakeComm {
    /// One that adds 1 to `drops` when it is dropped (closed).
    pub fn counting_drops(drops: &Arc<AtomicUsize>) -> Self {
        FakeComm {
            drops: Some(drops.clone()),
            reaper: None,
        }
    }

    /// One whose abort has not returned: it is [`Comm::wedged`], its
    /// broadcasts time out, and what it keeps is dropped once
    /// [`Reaper::returned`] is called on `reaper`.
    pub fn wedged(reaper: &Reaper) -> Self {
        FakeComm {
            drops: None,
            reaper: Some(reaper.clone()),
        }
    }
}

impl Comm for FakeComm {
    fn rank(&self) -> u32 {
        0
    }
    fn world(&self) -> u32 {
        2
    }
    fn broadcast(
        &mut self,
        _: u32,
        _: &[u32],
        _: &mut dyn Region,
        _: u64,
        _: u64,
    ) -> Result<(), TransportError> {
        match self.reaper {
            Some(_) => Err(TransportError::Timeout("aborted".into())),
            None => Ok(()),
        }
    }
    fn wedged(&self) -> bool {
        self.reaper.is_some()
    }
    fn keep_until_stopped(&mut self, what: Box<dyn Send>) {
        match &self.reaper {
            Some(r) => r.after(what),
            // As the trait's default: kept for good.
            None => std::mem::forget(what),
        }
    }
}

impl Drop for FakeComm {
    fn drop(&mut self) {
        if let Some(d) = &self.drops {
            d.fetch_add(1, Ordering::SeqCst);
        }
    }
}
