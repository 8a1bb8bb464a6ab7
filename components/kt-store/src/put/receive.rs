//! The bytes of an upload: the batch stream of small files
//! (`PUT .../batch`) and each chunk of a large one (`PUT .../chunks/{n}`).
//!
//! Invariants: every byte lands in the session's staging version, never
//! in a published one; a chunk is logged (for resuming after a restart)
//! before it counts; a chunked file is finished once, by whichever chunk
//! completes it, and only if its root matches its entry's hash (a
//! deferred entry's root is kept for the commit instead); a corrupt or
//! cut batch stream, or a chunked file whose hash does not match, ends
//! the session and removes its staging area.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use blake3::hazmat::ChainingValue;
use futures::StreamExt;
use kt_service::{ApiError, ApiJson};
use kt_sync::SyncError;
use kt_sync::apply::WriteMode;
use kt_sync::batch::receive_stream;
use kt_sync::chunk::{ChunkHasher, Piece};
use kt_types::api::BatchAck;
use kt_types::{Entry, ErrorCode, Hash};

use crate::session::ChunkSlot;
use crate::state::{AppState, blocking, sync_err};

use super::end::abort_session;
use super::session;

/// `PUT /api/v1/puts/{session}/batch`: a frame stream of small files.
pub async fn batch(
    State(s): State<AppState>,
    Path(id): Path<String>,
    body: Body,
) -> Result<ApiJson<BatchAck>, ApiError> {
    let sess = session(&s, &id)?;
    // Each file written keeps the session alive, however long the stream runs.
    let alive = sess.clone();
    let touch: kt_sync::batch::Progress = Arc::new(move |_| alive.touch());
    let received = receive_stream(
        body.into_data_stream(),
        sess.batch.clone(),
        WriteMode::Direct,
        Some(touch),
    )
    .await;
    let got = match received {
        Ok(got) => got,
        Err(e) => {
            // A corrupt or cut stream ends the upload: its staging area goes, nothing is published.
            abort_session(&s, &id).await;
            return Err(sync_err(e));
        }
    };
    s.metrics
        .add_bytes_in_for(&sess.key, sess.meta.options.service.as_deref(), got.bytes);
    sess.received
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(got.indices.iter().copied());
    sess.hashed
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(got.hashed.iter().copied());
    sess.touch();
    Ok(ApiJson(BatchAck {
        files: got.files,
        bytes: got.bytes,
    }))
}

/// `PUT /api/v1/puts/{session}/files/{index}/chunks/{n}`: one chunk of a large file.
pub async fn chunk(
    State(s): State<AppState>,
    Path((id, index, n)): Path<(String, u32, u64)>,
    body: Body,
) -> Result<ApiJson<BatchAck>, ApiError> {
    let sess = session(&s, &id)?;
    let slot = sess.chunked.get(&index).cloned().ok_or_else(|| {
        ApiError::bad_request(format!(
            "entry #{index} is not a chunked file of this upload"
        ))
    })?;
    let entry = sess.meta.manifest.entries[index as usize].clone();
    let (offset, len) = slot
        .asm
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .range(n)
        .ok_or_else(|| {
            sync_err(SyncError::BadChunk {
                path: entry.path.clone(),
                chunk: n,
            })
        })?;
    let chunk_size = s.cfg.chunk_size;
    let received = receive_chunk(body, slot.clone(), offset, len, n, chunk_size, &entry.path).await;
    let (bytes, cv) = match received {
        Ok(Some(done)) => done,
        // The file was completed by an earlier copy of this chunk.
        Ok(None) => return Ok(ApiJson(BatchAck { files: 0, bytes: 0 })),
        Err(e) => return Err(e),
    };
    let logged = sess.clone();
    let written = blocking(move || {
        // Logged first: a restart from here on keeps the chunk.
        if let Some(log) = logged
            .chunk_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            && let Err(e) = crate::resume::log_chunk(log, index, n, &cv)
        {
            tracing::warn!(error = %e, "could not log a chunk: a restart would have it sent again");
        }
        let root = {
            let mut asm = slot.asm.lock().unwrap_or_else(|p| p.into_inner());
            asm.add_cv(n, cv);
            asm.root()
        };
        match root {
            Some(root) => complete(&slot, &entry, root),
            None => Ok(()),
        }
    })
    .await;
    if let Err(e) = written {
        if e.code == ErrorCode::HashMismatch {
            abort_session(&s, &id).await;
        }
        return Err(e);
    }
    s.metrics
        .add_bytes_in_for(&sess.key, sess.meta.options.service.as_deref(), bytes);
    Ok(ApiJson(BatchAck { files: 0, bytes }))
}

/// Finishes a chunked file once every chunk is in (`root`: merged from
/// their chaining values; the first caller does it): checks the root
/// against its entry's hash or, for a deferred entry, keeps it for the
/// commit to compare with the client's.
pub(super) fn complete(slot: &ChunkSlot, entry: &Entry, root: Hash) -> Result<(), SyncError> {
    if slot.done.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    let file = slot.file.write().unwrap_or_else(|p| p.into_inner()).take();
    let Some(file) = file else { return Ok(()) };
    if slot.deferred {
        *slot.root.lock().unwrap_or_else(|p| p.into_inner()) = Some(root);
    } else if Some(root) != entry.hash {
        file.discard();
        return Err(SyncError::HashMismatch {
            path: entry.path.clone(),
        });
    }
    file.finish(entry)?;
    slot.finished.store(true, Ordering::SeqCst);
    Ok(())
}

const WRITE_PIECE: u64 = 1 << 20;

/// Streams one chunk's body into its file at `offset`, hashing as it goes (no
/// buffering of the whole chunk). Returns the bytes written and the chunk's
/// chaining value, or `None` when the file is already complete.
async fn receive_chunk(
    body: Body,
    slot: Arc<ChunkSlot>,
    offset: u64,
    len: u64,
    n: u64,
    chunk_size: u64,
    path: &str,
) -> Result<Option<(u64, ChainingValue)>, ApiError> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<Bytes>>(16);
    let writer =
        kt_sync::task::spawn(move || -> Result<Option<(u64, ChainingValue)>, SyncError> {
            let guard = slot.file.read().unwrap_or_else(|p| p.into_inner());
            let Some(file) = guard.as_ref().filter(|_| !slot.done.load(Ordering::SeqCst)) else {
                return Ok(None);
            };
            let mut hasher = ChunkHasher::new(n, chunk_size);
            let mut pos = 0u64;
            while let Some(bufs) = rx.blocking_recv() {
                file.write_all_vectored_at(offset + pos, &bufs)?;
                for data in &bufs {
                    hasher.update(data);
                    pos += data.len() as u64;
                }
            }
            // blake3 has no chaining value for an empty subtree; an empty body
            // is a size mismatch, reported below.
            Ok(Some((
                pos,
                if pos == 0 { [0; 32] } else { hasher.finish() },
            )))
        });
    let mut stream = body.into_data_stream();
    let mut total = 0u64;
    let mut failure = None;
    let mut piece = Piece::new(WRITE_PIECE);
    while let Some(frame) = stream.next().await {
        let data = match frame {
            Ok(d) => d,
            Err(e) => {
                failure = Some(ApiError::new(
                    ErrorCode::Truncated,
                    format!("chunk body: {e}"),
                ));
                break;
            }
        };
        total += data.len() as u64;
        if total > len {
            failure = Some(ApiError::new(
                ErrorCode::PayloadTooLarge,
                format!("chunk {n} of {path:?} is longer than its {len} bytes"),
            ));
            break;
        }
        // Written in pieces of about a MiB: small frames copied together,
        // large ones as they came.
        piece.add(data);
        if piece.is_full() && tx.send(piece.take()).await.is_err() {
            break; // the writer failed; it says why
        }
    }
    if failure.is_none() && !piece.is_empty() {
        let _ = tx.send(piece.take()).await;
    }
    drop(tx);
    let written = writer
        .await
        .map_err(|e| ApiError::internal(format!("chunk writer failed: {}", e.0)))?;
    if let Some(e) = failure {
        return Err(e);
    }
    let written = written.map_err(sync_err)?;
    match written {
        Some((n_bytes, _)) if n_bytes != len => Err(sync_err(SyncError::SizeMismatch {
            path: format!("{path} chunk {n}"),
            expected: len,
            actual: n_bytes,
        })),
        other => Ok(other),
    }
}
