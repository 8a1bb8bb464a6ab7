//! The kt sync engine: everything about moving a tree that is not HTTP.
//!
//! - [`scan`]: walk a tree into a [`Manifest`](kt_types::Manifest), hashing with blake3,
//!   re-using a [`ScanCache`] so unchanged files are not re-hashed;
//! - [`diff`]: which entries a receiver lacks;
//! - [`batch`]: many small files framed into one stream, and its decoder;
//! - [`chunk`]: large files in chunks, verified by composing blake3 subtree hashes;
//! - [`apply`]: writing received entries into a directory safely (never through a symlink);
//! - [`publish`]: versioned directories with an atomic `current` switch.
//!
//! Invariant: no networking here. The crate reads and writes local files and exposes
//! streams of `Bytes`; servers and clients plug those into HTTP bodies.

pub mod apply;
pub mod batch;
pub mod chunk;
pub mod diff;
pub mod error;
pub mod publish;
pub mod scan;

pub use error::SyncError;

/// The digest of a manifest: blake3 of its JSON encoding. Sender and receiver
/// encode the same struct with the same encoder, so equal trees give equal digests.
pub fn manifest_digest(m: &kt_types::Manifest) -> kt_types::Hash {
    let mut h = blake3::Hasher::new();
    // Writing JSON into a hasher cannot fail.
    let _ = serde_json::to_writer(HashWriter(&mut h), m);
    kt_types::Hash(*h.finalize().as_bytes())
}

struct HashWriter<'a>(&'a mut blake3::Hasher);

impl std::io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
pub use scan::{ScanCache, scan};

/// Defaults of the transfer engine; every one is configurable by the caller.
pub mod defaults {
    /// Files larger than this are split into chunks (a power of two, at least 1 KiB).
    pub const CHUNK_SIZE: u64 = 8 << 20;
    /// Parallel streams (batch bodies and chunk requests in flight).
    pub const STREAMS: usize = 4;
}
