//! The kt store server: holds `locale=store` data and speaks the sync protocol.
//!
//! - [`keys`]: per-key versioned directories on disk, the current manifest of
//!   each, read pins, and garbage collection of superseded versions;
//! - [`put`]: upload sessions (plan, batch stream, chunks, commit);
//! - [`read`]: the store as a [`kt_service::reads::ReadSource`] (a read pins
//!   its version; the lease protocol itself is shared), tree listing and deletes;
//! - [`registrar`]: announcing the store and its keys to the metadata server.
//!
//! Invariants: a put is staged in a fresh version directory and published by an
//! atomic symlink switch, so readers see the old tree or the new one; a version
//! that a reader has pinned is never deleted under it; every file is verified
//! against its blake3 hash before a version is published.

pub mod keys;
pub mod put;
pub mod read;
pub mod registrar;
mod server;

pub use server::{Config, StoreError, StoreHandle, run, start};
