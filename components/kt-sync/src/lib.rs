//! The kt sync engine: everything about moving a tree that is not HTTP.
//!
//! - [`scan`]: walk a tree into a [`Manifest`](kt_types::Manifest), hashing with blake3,
//!   re-using a [`ScanCache`] so unchanged files are not re-hashed;
//! - [`diff`]: which entries a receiver lacks;
//! - [`batch`]: many small files framed into one stream, and its decoder;
//! - [`chunk`]: large files in chunks, verified by composing blake3 subtree hashes;
//! - [`apply`]: writing received entries into a directory safely (never through a symlink);
//! - [`publish`]: versioned directories with an atomic `current` switch;
//! - [`du`]: the bytes a directory holds on disk.
//!
//! Invariant: no networking here. The crate reads and writes local files and exposes
//! streams of `Bytes`; servers and clients plug those into HTTP bodies.

pub mod apply;
pub mod batch;
pub mod beneath;
pub mod chunk;
pub mod diff;
pub mod du;
pub mod error;
pub mod publish;
pub mod scan;
pub mod task;

pub use error::SyncError;

/// The digest of a manifest: blake3 of its binary encoding
/// ([`kt_types::codec`]), which sender and receiver produce identically.
pub fn manifest_digest(m: &kt_types::Manifest) -> kt_types::Hash {
    digest_of_encoded(&kt_types::codec::to_bytes(m))
}

/// The digest of an already encoded manifest.
pub fn digest_of_encoded(bytes: &[u8]) -> kt_types::Hash {
    kt_types::Hash(*blake3::hash(bytes).as_bytes())
}

pub use scan::{ScanCache, scan};

/// Defaults of the transfer engine; every one is configurable by the caller.
pub mod defaults {
    /// Files larger than this are split into chunks (a power of two, at least 1 KiB).
    pub const CHUNK_SIZE: u64 = 8 << 20;
    /// Parallel streams (batch bodies and chunk requests in flight).
    pub const STREAMS: usize = 4;
}
