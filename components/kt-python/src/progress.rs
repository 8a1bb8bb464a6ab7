//! A transfer's progress handed to a Python callable (`progress=` of
//! `kt.put`/`kt.get`): called as `f(bytes_done, bytes_total, files_total,
//! finished)` when the transfer knows its size, then at most ten times a
//! second while bytes move, and once at the end. The Python half wraps the
//! caller's function (it receives a `kt.Progress`).
//!
//! The call takes the GIL on the runtime thread that reports (the caller's
//! thread has let it go). A callable that raises stops the transfer: the
//! exception is kept and raised by the call ([`Callback::failure`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kt_client::Progress;
use kt_client::progress::ProgressSink;
use pyo3::prelude::*;

/// How often a transfer in flight reports.
const EVERY: Duration = Duration::from_millis(100);

pub struct Callback {
    f: Py<PyAny>,
    total: AtomicU64,
    files: AtomicU64,
    done: AtomicU64,
    last: Mutex<Option<Instant>>,
    failed: Mutex<Option<PyErr>>,
}

impl Callback {
    pub fn new(f: Py<PyAny>) -> Arc<Callback> {
        Arc::new(Callback {
            f,
            total: AtomicU64::new(0),
            files: AtomicU64::new(0),
            done: AtomicU64::new(0),
            last: Mutex::new(None),
            failed: Mutex::new(None),
        })
    }

    /// The sink to give kt-client.
    pub fn progress(self: &Arc<Self>) -> Progress {
        Progress::new(self.clone())
    }

    /// The exception the callable raised, if it did (taken).
    pub fn failure(&self) -> Option<PyErr> {
        crate::locked(&self.failed).take()
    }

    /// Whether the callable raised.
    pub fn has_failed(&self) -> bool {
        crate::locked(&self.failed).is_some()
    }

    fn report(&self, finished: bool) {
        if self.has_failed() {
            return;
        }
        if !finished {
            let mut last = crate::locked(&self.last);
            let now = Instant::now();
            if last.is_some_and(|t| now.duration_since(t) < EVERY) {
                return;
            }
            *last = Some(now);
        }
        let args = (
            self.done.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
            self.files.load(Ordering::Relaxed),
            finished,
        );
        let _ = Python::try_attach(|py| {
            if let Err(e) = self.f.call1(py, args) {
                crate::locked(&self.failed).get_or_insert(e);
            }
        });
    }
}

impl ProgressSink for Callback {
    fn start(&self, bytes: u64, files: u64) {
        self.total.store(bytes, Ordering::Relaxed);
        self.files.store(files, Ordering::Relaxed);
        *crate::locked(&self.last) = None;
        self.report(false);
    }

    fn advance(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
        self.report(false);
    }

    fn finish(&self) {
        self.report(true);
    }
}
