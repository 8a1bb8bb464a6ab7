//! The chunks of a changed large file that the current version already
//! has: copied from its file in the store, not sent.
//!
//! A file whose size is the current version's file's at its path but not
//! its content (written in place, or a checkpoint of the same shape) is
//! needed, and the client sent the chaining values of its chunks
//! ([`kt_types::api::PutRequest::chunks`]: it hashed the file chunk by
//! chunk when the plan asked it to, `hash_first`). The store reads the
//! base file once, copies into the staging file each chunk whose value
//! is the client's, and answers those chunks in `have`: the client sends
//! only the others.
//!
//! Invariants: a chunk is copied only when the value of the bytes read
//! from the base file now equals the client's value for it, and it is
//! logged like a chunk received (a restart's survey verifies it again);
//! the file's root is still checked against its manifest hash once every
//! chunk is in, as for any chunked file. Best effort: a base file that
//! cannot be read (removed meanwhile, say) or a chunk that cannot be
//! written leaves the rest to be sent.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use kt_sync::SyncError;
use kt_sync::chunk::{chunk_count, chunk_cv, chunk_range};
use kt_types::api::{ChunkValues, HaveChunks};
use kt_types::{EntryKind, Hash, Manifest};

use crate::session::ChunkSlot;
use crate::state::blocking;

use super::receive::complete;

/// The current version's tree on disk and its manifest.
pub(super) type Base = (PathBuf, Arc<Manifest>);

/// A needed large file of which the base version has a file of the same
/// path and size, and the client's chunk values.
pub(super) struct Seed {
    pub(super) index: u32,
    /// The base version's file.
    pub(super) base: PathBuf,
    pub(super) size: u64,
    pub(super) values: Vec<Hash>,
    pub(super) slot: Arc<ChunkSlot>,
}

/// The seed of needed entry `i` of `m` (to be staged in `slot`): when
/// the client sent the values of its chunks at the store's `chunk_size`,
/// one per chunk, and `base` has a regular file at its path of its size.
pub(super) fn like(
    m: &Manifest,
    i: u32,
    sent: &std::collections::HashMap<u32, &ChunkValues>,
    base: Option<&Base>,
    chunk_size: u64,
    slot: &Arc<ChunkSlot>,
) -> Option<Seed> {
    let e = &m.entries[i as usize];
    let (root, bm) = base?;
    let v = sent.get(&i)?;
    if v.chunk_size != chunk_size || v.values.len() as u64 != chunk_count(e.size, chunk_size) {
        return None;
    }
    let j = bm
        .entries
        .binary_search_by(|b| b.path.as_bytes().cmp(e.path.as_bytes()))
        .ok()?;
    let b = &bm.entries[j];
    (b.kind == EntryKind::File && b.size == e.size).then(|| Seed {
        index: i,
        base: root.join(&b.path),
        size: e.size,
        values: v.values.clone(),
        slot: slot.clone(),
    })
}

/// Copies each seed's matching chunks from its base file into its
/// staging file (logged in `log`), off the async threads. Returns the
/// log, the chunks copied (for `have`) and their bytes. A file all of
/// whose chunks matched is finished now (checked against its hash: an
/// error if it differs, which the plan answers).
pub(super) async fn from_base(
    seeds: Vec<Seed>,
    chunk_size: u64,
    mut log: File,
    m: Arc<Manifest>,
) -> Result<(File, Vec<HaveChunks>, u64), kt_service::ApiError> {
    blocking(move || {
        let mut have = Vec::new();
        let mut bytes = 0;
        for seed in &seeds {
            let chunks = copy_matching(seed, chunk_size, &mut log);
            if chunks.is_empty() {
                continue;
            }
            bytes += chunks
                .iter()
                .filter_map(|&n| chunk_range(seed.size, chunk_size, n).map(|(_, len)| len))
                .sum::<u64>();
            let root = seed
                .slot
                .asm
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .root();
            if let Some(root) = root {
                complete(&seed.slot, &m.entries[seed.index as usize], root)?;
            }
            have.push(HaveChunks {
                index: seed.index,
                chunks,
            });
        }
        Ok::<_, SyncError>((log, have, bytes))
    })
    .await
}

/// The chunks of `seed`'s base file whose values are the client's,
/// written into its staging file and its assembly, ascending.
fn copy_matching(seed: &Seed, chunk_size: u64, log: &mut File) -> Vec<u64> {
    let mut copied = Vec::new();
    let base = match File::open(&seed.base) {
        Ok(f) => f,
        Err(e) => {
            tracing::debug!(path = %seed.base.display(), error = %e, "base file not read: its chunks are sent");
            return copied;
        }
    };
    let guard = seed.slot.file.read().unwrap_or_else(|p| p.into_inner());
    let Some(file) = guard.as_ref() else {
        return copied;
    };
    let mut buf = Vec::new();
    for (n, want) in seed.values.iter().enumerate() {
        let n = n as u64;
        let Some((offset, len)) = chunk_range(seed.size, chunk_size, n) else {
            break;
        };
        buf.resize(len as usize, 0);
        if let Err(e) = base.read_exact_at(&mut buf, offset) {
            tracing::debug!(path = %seed.base.display(), error = %e, "base file not read whole: the rest is sent");
            break;
        }
        let cv = chunk_cv(&buf, n, chunk_size);
        if cv != want.0 {
            continue;
        }
        if let Err(e) = file.write_at(offset, &buf) {
            tracing::debug!(error = %e, "a chunk of the base file not copied: the rest is sent");
            break;
        }
        if let Err(e) = crate::resume::log_chunk(log, seed.index, n, &cv) {
            tracing::warn!(error = %e, "could not log a chunk: a restart would have it sent again");
        }
        seed.slot
            .asm
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .add_cv(n, cv);
        copied.push(n);
    }
    copied
}
