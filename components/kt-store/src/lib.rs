//! The kt store server: holds `locale=store` data and speaks the sync protocol.
//!
//! - [`keys`]: per-key versioned directories on disk, the current manifest of
//!   each, read pins, and garbage collection of superseded versions;
//! - [`state`]: the configuration and what every handler shares;
//! - [`session`]: upload sessions in progress;
//! - [`put`]: the upload handlers (plan, batch stream, chunks, commit, abort);
//! - [`versions`]: the store as a [`kt_service::reads::ReadSource`] (a read
//!   pins its version; the lease protocol itself is shared) and the removal
//!   of versions no reader needs;
//! - [`trees`]: tree listing and deletes;
//! - [`metrics`]: the gauges read at each scrape (disk, uploads, reads);
//! - [`registrar`]: announcing the store and its keys to the metadata server;
//! - [`resume`]: what an upload a restart interrupted left, verified, so
//!   that the same put planned again sends only the rest;
//! - [`reconcile`]: late registrations (retries, the start-up pass), conditional
//!   on the key not having moved on; the store's copies of keys that did are removed.
//!
//! Handler modules depend on `state`, `keys`, `session` and `versions`, never
//! on `server` (the composition root) or on each other.
//!
//! Invariants: a put is staged in a fresh version directory and published by an
//! atomic symlink switch, so readers see the old tree or the new one; a version
//! that a reader has pinned is never deleted under it; every file is verified
//! against its blake3 hash before a version is published.

pub mod keys;
pub mod metrics;
pub mod put;
pub mod reconcile;
pub mod registrar;
pub mod resume;
mod server;
pub mod session;
pub mod state;
pub mod trees;
pub mod versions;

pub use server::{StoreError, StoreHandle, run, start};
pub use state::Config;
