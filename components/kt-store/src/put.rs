//! Upload sessions: plan → batch stream and chunks → commit (or abort).
//!
//! A put may defer the hashes of files ([`PutRequest::deferred`]):
//! their manifest entries carry [`DEFERRED_HASH`] and the digest planned
//! with is provisional. [`plan`] checks them (`check_deferred`), asks the
//! client to hash first those the current version probably has
//! (`like_in_base`), and needs the others whole; [`chunk`] keeps the root
//! a large one's chunks merge into instead of checking it, [`batch`] the
//! hash of a small one as received; [`commit`] compares each
//! with the root the client sends ([`CommitRequest`]) and publishes the
//! manifest with the real hashes (`patch_roots`), whose digest is the
//! one a put that hashed first makes. Any mismatch discards the upload.
//! The whole protocol: `docs/sync-protocol.md`, "deferred hashes".

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use blake3::hazmat::ChainingValue;
use futures::StreamExt;
use kt_service::{ApiBytes, ApiError, ApiJson};
use kt_sync::SyncError;
use kt_sync::apply::{self, ChunkedFile, WriteMode};
use kt_sync::batch::{Expected, receive_stream};
use kt_sync::chunk::{ChunkAssembly, ChunkHasher};
use kt_types::api::{
    BatchAck, CommitRequest, CommitResponse, DEFERRED_HASH, DeferredRoot, HaveChunks, PutPlan,
    PutRequest,
};
use kt_types::codec;
use kt_types::{Entry, EntryKind, ErrorCode, Hash, Key, Manifest};

use crate::keys::{Published, VersionMeta};
use crate::session::{ChunkSlot, PutSession};
use crate::state::{AppState, Shared, blocking, sync_err};
use crate::versions::remove_versions;

/// The header of a put document as received: the key is parsed by hand so a bad
/// key is answered as `invalid_key`, naming the offending part.
#[derive(Debug, serde::Deserialize)]
struct PutHeader {
    key: String,
    digest: Hash,
    #[serde(default)]
    options: kt_types::api::PutOptions,
    #[serde(default)]
    deferred: Vec<u32>,
}

fn session(s: &Shared, id: &str) -> Result<Arc<PutSession>, ApiError> {
    let found = s
        .puts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(id)
        .cloned();
    let sess = found.ok_or_else(|| {
        ApiError::not_found(format!("no upload session {id:?} (expired or finished)"))
    })?;
    sess.touch();
    Ok(sess)
}

/// `POST /api/v1/puts`: validates the manifest, stages what the current version
/// already has, and answers which files must be sent.
pub async fn plan(
    State(s): State<AppState>,
    axum::extract::Extension(who): axum::extract::Extension<kt_types::auth::Principal>,
    // The manifest document, held against the store's body budget.
    ApiBytes(body, _budget): ApiBytes,
) -> Result<ApiJson<PutPlan>, ApiError> {
    let (head, encoded): (PutHeader, &[u8]) = codec::split_document(&body)
        .map_err(|e| ApiError::bad_request(format!("put request: {e}")))?;
    let mut req = PutRequest {
        key: Key::parse(&head.key)?,
        digest: head.digest,
        options: head.options,
        deferred: head.deferred,
    };
    if let Some(service) = &req.options.service {
        Key::parse(service).map_err(|e| ApiError::bad_request(format!("service name: {e}")))?;
    }
    // A put naming no service goes to the one service its token writes,
    // if it writes one (a pod's, in a cluster), else to the key's first
    // segment, as the metadata server records it.
    if req.options.service.is_none() {
        req.options.service = who.sole_service().map(str::to_owned);
    }
    // A workload puts only under its services.
    let service = who.write_service(&req.key, req.options.service.as_deref());
    if let Some(why) = who.refuses_write(&req.key, &service) {
        return Err(kt_service::forbidden(why));
    }
    // Nor replace a key another service owns (a put would hand it over).
    refuse_foreign_owner(&s, &who, &req.key).await?;
    let key = req.key.clone();
    let state = s.keys.state(&key);
    let mut st = state.lock().await;
    if let Some(cur) = st.current.as_ref().filter(|c| c.digest == req.digest) {
        // Unchanged tree: nothing moves; refresh the record (options may differ).
        let published = Published {
            meta: Arc::new(VersionMeta {
                options: req.options,
                ..(*cur.meta).clone()
            }),
            ..cur.clone()
        };
        // Registered under the key lock, like a commit: records keep publish order.
        s.registrar
            .register(&key, s.registration(&published))
            .await
            .map_err(|e| ApiError::new(ErrorCode::Unavailable, e.to_string()))?;
        return Ok(ApiJson(PutPlan {
            session: None,
            needed: Vec::new(),
            chunk_size: s.cfg.chunk_size,
            need_manifest: false,
            have: Vec::new(),
            deferred: false,
            hash_first: Vec::new(),
        }));
    }
    if encoded.is_empty() {
        return Ok(ApiJson(PutPlan {
            session: None,
            needed: Vec::new(),
            chunk_size: s.cfg.chunk_size,
            need_manifest: true,
            have: Vec::new(),
            deferred: false,
            hash_first: Vec::new(),
        }));
    }
    let t0 = Instant::now();
    let manifest = codec::decode(encoded)
        .map_err(|e| ApiError::new(ErrorCode::InvalidManifest, e.to_string()))?;
    manifest.validate(&s.cfg.limits)?;
    if kt_sync::digest_of_encoded(encoded) != req.digest {
        return Err(ApiError::bad_request(
            "the digest does not match the manifest",
        ));
    }
    let deferred = check_deferred(&manifest, &req.deferred)?;
    // A deferred file the current version probably has (same path, size
    // and mtime) is better hashed by the client than sent whole.
    if let Some(cur) = st.current.as_ref() {
        let hash_first = like_in_base(&manifest, &deferred, &cur.meta.manifest);
        if !hash_first.is_empty() {
            return Ok(ApiJson(PutPlan {
                session: None,
                needed: Vec::new(),
                chunk_size: s.cfg.chunk_size,
                need_manifest: false,
                have: Vec::new(),
                deferred: true,
                hash_first,
            }));
        }
    }
    let dir = s.keys.dir_of(&key);
    let base = st.current.clone();
    let key_name = key.to_string();
    let chunk_size = s.cfg.chunk_size;
    // The same tree, uploaded before a restart cut it off: resume it. Only
    // a staging version no upload holds: the session that adopted or
    // staged it holds it until it ends, through its commit, so two
    // sessions never write one version, and none writes into a version a
    // commit is publishing (the sessions map alone was not enough: a
    // commit takes its session out of it before it publishes). Found and
    // claimed under the key's lock.
    let adopt = crate::resume::find(&dir, &req.digest, |id| s.keys.claimed(&dir, id));
    let adopted = adopt.as_ref().and_then(|v| s.keys.claim(&dir, v));
    // A fresh staging version is made in the superseded version no reader
    // holds, if the key has one (taken under the key's lock: one plan uses it).
    let spare = match (&adopt, &base) {
        (None, Some(_)) => st.spare.take(),
        _ => None,
    };
    let digest = req.digest;
    let (version, manifest, left, log, dir, unused) = {
        let dir = dir.clone();
        let deferred = deferred.clone();
        blocking(move || {
            if let Some(version) = adopt {
                let staging = dir.version_path(&version);
                let log_path = dir.chunks_path(&version);
                let left =
                    crate::resume::survey(&staging, &log_path, &manifest, chunk_size, &deferred);
                // What is sent again whole goes into a fresh inode, not into
                // the one there (which might be shared: writes into it must
                // show nowhere else). A file whose chunks are resumed had one
                // link when surveyed. Best effort: what cannot be removed
                // fails its write as it would have.
                for &i in &left.needed {
                    if !left.chunks.contains_key(&i) {
                        let _ =
                            std::fs::remove_file(staging.join(&manifest.entries[i as usize].path));
                    }
                }
                let log = crate::resume::rewrite_log(&log_path, &left)
                    .map_err(|e| SyncError::io(&log_path, e))?;
                crate::resume::mark(&dir, &version, &digest)?;
                return Ok((version, manifest, left, log, dir, None));
            }
            let version = dir.stage()?;
            let staged = (|| {
                std::fs::write(dir.path().join("key"), key_name)
                    .map_err(|e| SyncError::io(dir.path(), e))?;
                let base_root = base.as_ref().map(|b| dir.version_path(&b.version));
                let base_pair = base
                    .as_ref()
                    .zip(base_root.as_deref())
                    .map(|(b, root)| (root, &*b.meta.manifest));
                let staged = crate::versions::stage(&dir, &version, spare, &manifest, base_pair)?;
                crate::resume::mark(&dir, &version, &digest)?;
                let log_path = dir.chunks_path(&version);
                let log =
                    std::fs::File::create(&log_path).map_err(|e| SyncError::io(&log_path, e))?;
                Ok((staged, log))
            })();
            match staged {
                Ok((staged, log)) => {
                    let left = crate::resume::Left {
                        needed: staged.needed,
                        ..Default::default()
                    };
                    Ok((version, manifest, left, log, dir, staged.unused))
                }
                Err(e) => {
                    let _ = dir.remove_version(&version);
                    Err(e)
                }
            }
        })
        .await?
    };
    // A spare too far from this tree to stage in goes, as superseded versions do.
    if let Some(unused) = unused {
        let dir = dir.clone();
        tokio::spawn(async move { remove_versions(&dir, vec![unused]).await });
    }
    // Still under the key's lock: a fresh version is claimed before any
    // other plan can see its marker.
    let claim = match adopted {
        Some(c) => c,
        None => s.keys.claim(&dir, &version).ok_or_else(|| {
            ApiError::internal(format!(
                "staging version {version} is held by another upload"
            ))
        })?,
    };
    // Room for what is to come, or a final answer now (not a transfer that
    // dies of ENOSPC at its end and starts over until its deadline).
    let room = {
        let data_dir = s.cfg.data_dir.clone();
        blocking(move || free_space(&data_dir)).await?
    };
    let wants: u64 = left
        .needed
        .iter()
        .map(|&i| manifest.entries[i as usize].size)
        .sum();
    if let Err(e) = room_for(&s, room, wants, left.needed.len() as u64) {
        drop_staging(&key, &dir, version, st.current.is_some()).await;
        return Err(e);
    }
    drop(st);

    if left.kept > 0 {
        tracing::info!(key = %key, version = %version, kept = left.kept, "upload resumed: what a restart interrupted is kept");
    }
    tracing::debug!(ms = t0.elapsed().as_millis() as u64, "upload staged");
    let staging = dir.version_path(&version);
    let mut batch = HashMap::new();
    let mut chunked = HashMap::new();
    let mut bytes_needed = 0;
    let mut have = Vec::new();
    let needed = left.needed;
    for &i in &needed {
        let e = &manifest.entries[i as usize];
        bytes_needed += e.size;
        let dest = staging.join(&e.path);
        if e.size > s.cfg.chunk_size {
            let kept = left.chunks.get(&i);
            let file = match kept {
                Some(_) => ChunkedFile::resume(&dest, e.size),
                None => ChunkedFile::create(&dest, e.size, WriteMode::Direct),
            };
            let file = match file {
                Ok(f) => f,
                Err(err) => {
                    let _ = dir.remove_version(&version);
                    return Err(sync_err(err));
                }
            };
            let mut asm = ChunkAssembly::new(e.size, s.cfg.chunk_size);
            if let Some(kept) = kept {
                for (n, cv) in kept {
                    asm.add_cv(*n, *cv);
                    bytes_needed -= asm.range(*n).map(|(_, len)| len).unwrap_or(0);
                }
                have.push(HaveChunks {
                    index: i,
                    chunks: kept.iter().map(|(n, _)| *n).collect(),
                });
            }
            // A deferred file a restart interrupted may be all there: it
            // is finished now, its root kept for the commit.
            let root = asm.root();
            let slot = Arc::new(ChunkSlot {
                file: RwLock::new(Some(file)),
                asm: Mutex::new(asm),
                done: AtomicBool::new(false),
                finished: AtomicBool::new(false),
                deferred: deferred.binary_search(&i).is_ok(),
                root: Mutex::new(None),
            });
            if let Some(root) = root.filter(|_| slot.deferred)
                && let Err(err) = complete(&slot, e, root)
            {
                let _ = dir.remove_version(&version);
                return Err(sync_err(err));
            }
            chunked.insert(i, slot);
        } else {
            // A deferred one is expected without a hash: written as it
            // comes, its hash kept for the commit.
            let mut entry = e.clone();
            if deferred.binary_search(&i).is_ok() {
                entry.hash = None;
            }
            batch.insert(i, Expected { dest, entry });
        }
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    let now = Instant::now();
    let sess = Arc::new(PutSession {
        id: id.clone(),
        key: req.key.clone(),
        dir,
        version,
        _claim: claim,
        meta: Arc::new(VersionMeta {
            key: req.key,
            manifest: Arc::new(manifest),
            options: req.options,
        }),
        digest: req.digest,
        deferred,
        received: Mutex::new(HashSet::new()),
        hashed: Mutex::new(HashMap::new()),
        batch: Arc::new(batch),
        chunked,
        started: now,
        touched: Mutex::new(now),
        bytes_needed,
        chunk_log: Mutex::new(Some(log)),
    });
    tracing::debug!(session = %id, key = %sess.key, needed = needed.len(), ms = t0.elapsed().as_millis() as u64, "upload planned");
    s.puts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id.clone(), sess);
    Ok(ApiJson(PutPlan {
        session: Some(id),
        needed,
        chunk_size: s.cfg.chunk_size,
        need_manifest: false,
        have,
        deferred: !req.deferred.is_empty(),
        hash_first: Vec::new(),
    }))
}

/// The deferred entries of a put ([`PutRequest::deferred`]), checked and
/// ascending: each in range, named once, a regular file carrying the
/// placeholder [`DEFERRED_HASH`]. One larger than the chunk size moves in
/// chunks, each hashed on arrival; a smaller one in a batch, hashed as it
/// is written.
fn check_deferred(m: &Manifest, deferred: &[u32]) -> Result<Vec<u32>, ApiError> {
    let mut out = deferred.to_vec();
    out.sort_unstable();
    if let Some(w) = out.windows(2).find(|w| w[0] == w[1]) {
        return Err(ApiError::bad_request(format!(
            "deferred entry #{} is named twice: name each deferred entry once",
            w[0]
        )));
    }
    for &i in &out {
        let e = m.entries.get(i as usize).ok_or_else(|| {
            ApiError::bad_request(format!(
                "deferred entry #{i} is out of range: the manifest has {} entries",
                m.entries.len()
            ))
        })?;
        let why = if e.kind != EntryKind::File {
            "is not a regular file: only a file's hash may be deferred"
        } else if e.hash != Some(DEFERRED_HASH) {
            "carries a hash: a deferred entry carries the placeholder (all zero) until its root is sent at commit"
        } else {
            continue;
        };
        return Err(ApiError::bad_request(format!(
            "deferred entry #{i} ({:?}) {why}",
            e.path
        )));
    }
    Ok(out)
}

/// The `deferred` entries of `m` that `base` has a file like (same path,
/// size and mtime): probably unchanged, cheaper hashed than sent.
fn like_in_base(m: &Manifest, deferred: &[u32], base: &Manifest) -> Vec<u32> {
    deferred
        .iter()
        .copied()
        .filter(|&i| {
            let e = &m.entries[i as usize];
            base.entries
                .binary_search_by(|b| b.path.as_bytes().cmp(e.path.as_bytes()))
                .is_ok_and(|j| {
                    let b = &base.entries[j];
                    b.kind == EntryKind::File
                        && (b.size, b.mtime, b.mtime_nsec) == (e.size, e.mtime, e.mtime_nsec)
                })
        })
        .collect()
}

/// The manifest a commit publishes: the planned one with each deferred
/// entry's placeholder replaced by its root (None when nothing was
/// deferred). Every deferred entry needs a root in `sent` equal to the
/// root `received` merged from the chunks that arrived: a root missing,
/// repeated or for an entry not deferred is a bad request; a different
/// one is a `hash_mismatch` (the upload is then discarded).
fn patch_roots(
    m: &Manifest,
    deferred: &[u32],
    sent: &[DeferredRoot],
    received: impl Fn(u32) -> Option<Hash>,
) -> Result<Option<Manifest>, ApiError> {
    let mut by_index = std::collections::BTreeMap::new();
    for r in sent {
        if deferred.binary_search(&r.index).is_err() {
            return Err(ApiError::bad_request(format!(
                "a root was sent for entry #{}, whose hash this upload did not defer",
                r.index
            )));
        }
        if by_index.insert(r.index, r.hash).is_some() {
            return Err(ApiError::bad_request(format!(
                "the root of entry #{} is sent twice",
                r.index
            )));
        }
    }
    if deferred.is_empty() {
        return Ok(None);
    }
    let mut out = m.clone();
    for &i in deferred {
        let e: &mut Entry = &mut out.entries[i as usize];
        let Some(&hash) = by_index.get(&i) else {
            return Err(ApiError::bad_request(format!(
                "commit without the root of deferred entry #{i} ({:?}): send every deferred entry's root in the commit's `roots`",
                e.path
            )));
        };
        let got = received(i).ok_or_else(|| {
            ApiError::internal(format!("deferred entry #{i} ({:?}) has no root", e.path))
        })?;
        if got != hash {
            return Err(ApiError::new(
                ErrorCode::HashMismatch,
                format!(
                    "{:?}: the root sent at commit ({hash}) is not the hash of the content received ({got}): nothing is published; put it again",
                    e.path
                ),
            ));
        }
        e.hash = Some(hash);
    }
    Ok(Some(out))
}

/// What each file costs on disk besides its bytes (a block, an inode, the
/// staging's directory entries), counted when a put asks for room.
const PER_FILE: u64 = 4096;

/// Bytes free to this process on the data directory's file system, and
/// its size.
pub(crate) fn free_space(dir: &std::path::Path) -> Result<(u64, u64), SyncError> {
    let v = rustix::fs::statvfs(dir).map_err(|e| SyncError::io(dir, e.into()))?;
    Ok((
        v.f_bavail.saturating_mul(v.f_frsize),
        v.f_blocks.saturating_mul(v.f_frsize),
    ))
}

/// Refuses a put that needs `bytes` in `files` new files when the data
/// directory's free room, less what uploads in progress were promised and
/// the reserve ([`crate::Config::reserve`]), cannot take it.
fn room_for(s: &Shared, (free, total): (u64, u64), bytes: u64, files: u64) -> Result<(), ApiError> {
    let promised: u64 = s
        .puts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .map(|p| p.bytes_needed)
        .sum();
    let reserve = s.cfg.reserve.unwrap_or((total / 50).min(1 << 30));
    let needs = bytes.saturating_add(files.saturating_mul(PER_FILE));
    let usable = free.saturating_sub(reserve).saturating_sub(promised);
    if needs <= usable {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::InsufficientStorage,
        format!(
            "store full: this put needs {}, {} is free ({} kept in reserve, {} promised to uploads in progress)",
            iec(needs),
            iec(free),
            iec(reserve),
            iec(promised)
        ),
    ))
}

/// `n` bytes for people: `52428800 bytes (50.00 MiB)`.
fn iec(n: u64) -> String {
    format!("{n} bytes ({})", kt_types::size::human(n))
}

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
fn complete(slot: &ChunkSlot, entry: &Entry, root: Hash) -> Result<(), SyncError> {
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

const WRITE_PIECE: usize = 1 << 20;

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
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    let writer =
        kt_sync::task::spawn(move || -> Result<Option<(u64, ChainingValue)>, SyncError> {
            let guard = slot.file.read().unwrap_or_else(|p| p.into_inner());
            let Some(file) = guard.as_ref().filter(|_| !slot.done.load(Ordering::SeqCst)) else {
                return Ok(None);
            };
            let mut hasher = ChunkHasher::new(n, chunk_size);
            let mut pos = 0u64;
            while let Some(data) = rx.blocking_recv() {
                file.write_at(offset + pos, &data)?;
                hasher.update(&data);
                pos += data.len() as u64;
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
    let mut pending = bytes::BytesMut::with_capacity(WRITE_PIECE);
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
        // Network frames are small; write in pieces of about a MiB.
        pending.extend_from_slice(&data);
        if pending.len() >= WRITE_PIECE && tx.send(pending.split().freeze()).await.is_err() {
            break; // the writer failed; it says why
        }
    }
    if failure.is_none() && !pending.is_empty() {
        let _ = tx.send(pending.freeze()).await;
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

/// Refuses `who` (limited to some services) a put of `key` when another
/// service owns it, as the metadata server says: the service whose base
/// path holds it (only that service writes there), else its record's. A
/// token always puts under its own services' base paths. Checked when a
/// put is planned and again, under the key's lock, when it is committed:
/// a key another service put meanwhile is not taken over.
async fn refuse_foreign_owner(
    s: &Shared,
    who: &kt_types::auth::Principal,
    key: &Key,
) -> Result<(), ApiError> {
    if !who.asks_owner(key) {
        return Ok(());
    }
    match s.registrar.owner(key).await {
        Ok(o) => {
            match who.refuses_takeover(key, o.service.as_deref().map(|sv| (sv, o.base_path))) {
                Some(why) => Err(kt_service::forbidden(why)),
                None => Ok(()),
            }
        }
        Err(e) if e.code() == kt_types::ErrorCode::NotFound => Ok(()),
        Err(e) => Err(ApiError::from_call(
            e,
            &format!("asking the metadata server who owns {key}"),
            kt_types::ErrorCode::Unavailable,
        )),
    }
}

/// Finishes the staged tree, writes its description and switches `current` to
/// it (the committer, `who`, must still be allowed to: checked under the
/// key's lock). Returns the superseded versions that no reader holds.
async fn publish(
    s: &Shared,
    (sess, who): (&Arc<PutSession>, &kt_types::auth::Principal),
    published: &Published,
) -> Result<(Vec<String>, Locked), ApiError> {
    {
        let sess = sess.clone();
        let meta = published.meta.clone();
        blocking(move || {
            let root = sess.dir.version_path(&sess.version);
            apply::finish_tree(&root, &meta.manifest)?;
            sess.dir.write_meta(&sess.version, &meta.to_bytes())?;
            // Complete: no longer an upload to resume (before it is
            // published, so a published version is never adopted).
            sess.chunk_log
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            sess.dir.drop_resume(&sess.version);
            Ok::<(), SyncError>(())
        })
        .await?;
    }
    let state = s.keys.state(&sess.key);
    let mut st = state.lock_owned().await;
    // Another put may have published the key since this one was planned:
    // its owner decides, now, under the lock every publish takes (a key
    // under the putter's own base path is its own, whoever put it).
    if let Some(cur) = &st.current {
        let owner = cur.meta.options.service.as_deref();
        let owner = owner.unwrap_or_else(|| sess.key.service());
        if who.services.is_some() && !who.serves(owner) && !who.serves(sess.key.service()) {
            return Err(kt_service::forbidden(format!(
                "{} was put by service {owner:?} since this upload began: it is left as it is",
                sess.key
            )));
        }
    }
    refuse_foreign_owner(s, who, &sess.key).await?;
    let dir = sess.dir.clone();
    let version = sess.version.clone();
    let previous = blocking(move || dir.publish(&version)).await?;
    let before = st.current.replace(published.clone());
    let collectable = match previous {
        Some(prev) if prev != sess.version => st.retire(prev),
        _ => Vec::new(),
    };
    // The version superseded, if no reader holds it, is kept for the next put to stage in.
    let collectable = crate::versions::keep_spare(
        &mut st,
        before.as_ref(),
        &published.meta.manifest,
        collectable,
    );
    Ok((collectable, st))
}

/// A key's state, locked.
type Locked = tokio::sync::OwnedMutexGuard<crate::keys::KeyState>;

/// `POST /api/v1/puts/{session}/commit` (body: [`CommitRequest`], empty
/// without deferred entries): verifies completeness and the deferred
/// entries' roots, and publishes atomically.
pub async fn commit(
    State(s): State<AppState>,
    axum::extract::Extension(who): axum::extract::Extension<kt_types::auth::Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<ApiJson<CommitResponse>, ApiError> {
    let req: CommitRequest = if body.is_empty() {
        CommitRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("commit request: {e}")))?
    };
    let sess = s
        .puts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&id)
        .ok_or_else(|| {
            ApiError::not_found(format!("no upload session {id:?} (expired or finished)"))
        })?;
    let missing_chunked = sess
        .chunked
        .values()
        .filter(|c| !c.finished.load(Ordering::SeqCst))
        .count();
    let check: Vec<String> = {
        let received = sess.received.lock().unwrap_or_else(|p| p.into_inner());
        sess.batch
            .iter()
            .filter(|(i, _)| !received.contains(i))
            .map(|(_, x)| x.entry.path.clone())
            .take(3)
            .collect()
    };
    if !check.is_empty() || missing_chunked > 0 {
        // Not complete: keep the session so the client can finish it.
        s.puts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, sess);
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!(
                "upload incomplete: {} chunked file(s) unfinished; missing e.g. {check:?}",
                missing_chunked
            ),
        ));
    }
    let roots = patch_roots(
        &sess.meta.manifest,
        &sess.deferred,
        &req.roots,
        |i| match sess.chunked.get(&i) {
            Some(slot) => *slot.root.lock().unwrap_or_else(|p| p.into_inner()),
            None => sess
                .hashed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&i)
                .copied(),
        },
    );
    let patched = match roots {
        Ok(p) => p,
        Err(e) => {
            if e.code == ErrorCode::HashMismatch {
                // What arrived is not what the client read: nothing of it is published.
                discard(&s, sess).await;
            } else {
                s.puts
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id, sess);
            }
            return Err(e);
        }
    };
    let t0 = Instant::now();
    // With deferred entries, the version is the manifest with their real
    // hashes, and its digest theirs: what a put that hashed first made.
    let published = match patched {
        Some(m) => Published {
            version: sess.version.clone(),
            digest: kt_sync::manifest_digest(&m),
            meta: Arc::new(VersionMeta {
                manifest: Arc::new(m),
                ..(*sess.meta).clone()
            }),
        },
        None => Published {
            version: sess.version.clone(),
            meta: sess.meta.clone(),
            digest: sess.digest,
        },
    };
    // The key stays locked until the metadata server has the record, so records
    // of one key arrive in the order their versions were published.
    let (collectable, _key_lock) = match publish(&s, (&sess, &who), &published).await {
        Ok(c) => c,
        Err(e) => {
            // Not published: the staging version must not outlive the session.
            discard(&s, sess).await;
            return Err(e);
        }
    };
    // Superseded versions go in the background; the answer does not wait for them.
    let dir = sess.dir.clone();
    tokio::spawn(async move { remove_versions(&dir, collectable).await });
    s.metrics
        .observe_transfer("put", sess.started.elapsed().as_secs_f64());
    tracing::info!(key = %sess.key, version = %sess.version, bytes = sess.bytes_needed, ms = t0.elapsed().as_millis() as u64, "published");
    let record = s
        .registrar
        .register(&sess.key, s.registration(&published))
        .await
        .map_err(|e| {
            ApiError::new(
                ErrorCode::Unavailable,
                format!("data published in the store, but the metadata server did not record it yet (retrying in the background): {e}"),
            )
        })?;
    Ok(ApiJson(CommitResponse { record }))
}

/// Removes a session's staging version; a key that was never published and has
/// no other upload in flight loses its directory too.
async fn discard(s: &Shared, sess: Arc<PutSession>) {
    let state = s.keys.state(&sess.key);
    let st = state.lock().await;
    drop_staging(
        &sess.key,
        &sess.dir,
        sess.version.clone(),
        st.current.is_some(),
    )
    .await;
}

/// Removes the staging `version` of `key` (its state locked by the caller);
/// a key never `published` loses its directory too.
async fn drop_staging(
    key: &Key,
    dir: &kt_sync::publish::VersionedDir,
    version: String,
    published: bool,
) {
    remove_versions(dir, vec![version]).await;
    if !published {
        // Only when no other upload is staging in it (its `v-*` would remain).
        let dir = dir.clone();
        if let Err(e) = blocking(move || dir.remove_if_unused()).await {
            tracing::warn!(%key, error = %e, "could not remove an unpublished key's directory");
        }
    }
}

/// Ends a session and removes its staging area; false when there was none.
async fn abort_session(s: &Shared, id: &str) -> bool {
    let sess = s.puts.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    match sess {
        Some(sess) => {
            discard(s, sess).await;
            true
        }
        None => false,
    }
}

/// `DELETE /api/v1/puts/{session}`: drops an upload and its staging area.
pub async fn abort(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if abort_session(&s, &id).await {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("no upload session {id:?}")))
    }
}

/// Aborts sessions idle for longer than the session TTL.
pub async fn sweep(s: &Shared, now: Instant) {
    let stale: Vec<Arc<PutSession>> = {
        let mut puts = s.puts.lock().unwrap_or_else(|p| p.into_inner());
        let ids: Vec<String> = puts
            .iter()
            .filter(|(_, p)| now.duration_since(p.idle_since()) > s.cfg.session_ttl)
            .map(|(id, _)| id.clone())
            .collect();
        ids.iter().filter_map(|id| puts.remove(id)).collect()
    };
    for sess in stale {
        tracing::info!(session = %sess.id, key = %sess.key, "upload session expired");
        discard(s, sess).await;
    }
    // Uploads a restart interrupted and no put resumed in time.
    let due: Vec<crate::resume::Leftover> = {
        let mut left = s.keys.leftovers.lock().unwrap_or_else(|p| p.into_inner());
        let (due, keep) = left.drain(..).partition(|l| now >= l.until);
        *left = keep;
        due
    };
    for l in due {
        // Under the key's lock, like a discard: a plan may be adopting it
        // (it marks it young again) or staging beside it.
        let state = l.key.as_ref().map(|k| s.keys.state(k));
        let st = match &state {
            Some(state) => Some(state.lock().await),
            None => None,
        };
        let marker = l.dir.resume_path(&l.id);
        let resumed = l.adopted()
            || s.keys.claimed(&l.dir, &l.id)
            || s.puts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .any(|p| p.version == l.id && p.dir.path() == l.dir.path());
        if resumed || !marker.exists() {
            continue;
        }
        tracing::info!(dir = %l.dir.path().display(), version = %l.id, "interrupted upload not resumed in time: removed");
        remove_versions(&l.dir, vec![l.id]).await;
        if st.as_ref().is_some_and(|st| st.current.is_none()) {
            let dir = l.dir.clone();
            let _ = blocking(move || dir.remove_if_unused()).await;
        }
    }
}

/// Ends every session at shutdown, keeping their staging versions: a put
/// planned again after the restart resumes from them ([`crate::resume`]);
/// the next start removes those not resumed within the session TTL.
pub async fn interrupt_all(s: &Shared) {
    let all: Vec<Arc<PutSession>> = s
        .puts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .drain()
        .map(|(_, v)| v)
        .collect();
    for sess in all {
        tracing::info!(session = %sess.id, key = %sess.key, "upload interrupted by shutdown; kept for resuming");
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path as FsPath;

    use super::*;
    use axum::Extension;
    use kt_types::auth::Principal;

    const CHUNK: u64 = 64 << 10;

    /// The store's shared state over `data_dir`, as `server::start` builds
    /// it (a metadata server that is not there: registrations fail).
    fn shared(data_dir: &FsPath) -> AppState {
        let token = kt_service::Token::new("t").unwrap();
        let mut cfg = crate::Config::new(data_dir, "http://127.0.0.1:9", token.clone());
        cfg.chunk_size = CHUNK;
        cfg.reserve = Some(0);
        let keys = Arc::new(crate::keys::Keys::open(data_dir, cfg.session_ttl).unwrap());
        let registrar = Arc::new(
            crate::registrar::Registrar::new(&cfg.metadata_url, "http://s", token).unwrap(),
        );
        let metrics = Arc::new(kt_service::Metrics::new());
        let reads = kt_service::reads::Reads::new(
            crate::versions::StoreVersions {
                keys: keys.clone(),
                chunk_size: CHUNK,
            },
            registrar.clone(),
            metrics.clone(),
            cfg.lease_ttl,
        );
        Arc::new(Shared {
            keys,
            puts: Default::default(),
            reads,
            metrics,
            registrar,
            url: "http://s".into(),
            cfg,
        })
    }

    async fn plan_of(s: &AppState, doc: &[u8]) -> (PutPlan, Arc<PutSession>) {
        let p = plan(
            State(s.clone()),
            Extension(Principal::admin()),
            ApiBytes(Bytes::copy_from_slice(doc), None),
        )
        .await
        .unwrap()
        .0;
        let id = p.session.clone().unwrap();
        let sess = s.puts.lock().unwrap().get(&id).cloned().unwrap();
        (p, sess)
    }

    async fn send_chunks(s: &AppState, id: &str, index: u32, data: &[u8], chunks: u64) {
        for n in 0..chunks {
            let (off, len) = kt_sync::chunk::chunk_range(data.len() as u64, CHUNK, n).unwrap();
            let body = Body::from(data[off as usize..(off + len) as usize].to_vec());
            chunk(State(s.clone()), Path((id.to_owned(), index, n)), body)
                .await
                .unwrap();
        }
    }

    /// The chaos run's violation: a store restarted in the middle of an
    /// upload keeps its staging version for resuming; the put planned again
    /// adopts it (nothing left to send) and commits. A second plan of the
    /// same tree that came while that commit was publishing (its session
    /// already out of the sessions map, the resume marker not yet removed)
    /// adopted the same version, truncated its file and wrote it again —
    /// into the version just published — then published it a second time.
    /// A staging version belongs to one upload from plan to end of commit.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_staging_version_is_never_adopted_by_two_uploads() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        let big: Vec<u8> = (0..4 * CHUNK as u32 + 100)
            .map(|i| (i % 251) as u8)
            .collect();
        std::fs::write(src.join("large-0.bin"), &big).unwrap();
        let m = kt_sync::scan(&src, &mut kt_sync::ScanCache::default()).unwrap();
        let index = m
            .entries
            .iter()
            .position(|e| e.path == "large-0.bin")
            .unwrap() as u32;
        let chunks = kt_sync::chunk::chunk_count(big.len() as u64, CHUNK);
        let header =
            serde_json::json!({ "key": "chaos/s2", "digest": kt_sync::manifest_digest(&m) });
        let doc = codec::encode_document(&header, &m);
        let data = d.path().join("store");

        // A store killed after every chunk arrived, before the commit.
        let s = shared(&data);
        let (p, _) = plan_of(&s, &doc).await;
        send_chunks(&s, p.session.as_deref().unwrap(), index, &big, chunks).await;
        drop(s);

        // Restarted: the put planned again resumes, with nothing to send.
        let s = shared(&data);
        let (a, sess_a) = plan_of(&s, &doc).await;
        assert!(a.needed.is_empty(), "{a:?}");
        let a_id = a.session.unwrap();
        // Its commit begins: the session leaves the map (and stays alive
        // while the commit publishes it).
        s.puts.lock().unwrap().remove(&a_id).unwrap();
        // Meanwhile the same tree is planned again (a retry, another putter).
        let (b, sess_b) = plan_of(&s, &doc).await;
        assert_ne!(
            sess_b.version, sess_a.version,
            "two uploads adopted one staging version"
        );
        assert_eq!(b.needed, [index], "a fresh staging version needs the file");
        let a_version = sess_a.version.clone();

        // A's commit goes on and publishes (the metadata server is not
        // there: the record fails, the data is published).
        s.puts.lock().unwrap().insert(a_id.clone(), sess_a);
        let committed = commit(
            State(s.clone()),
            Extension(Principal::admin()),
            Path(a_id),
            Bytes::new(),
        )
        .await;
        assert!(committed.is_err_and(|e| e.code == ErrorCode::Unavailable));
        let dir = s.keys.dir_of(&Key::parse("chaos/s2").unwrap());
        assert_eq!(dir.current().unwrap().as_deref(), Some(a_version.as_str()));
        let published = dir.version_path(&a_version).join("large-0.bin");
        assert_eq!(std::fs::read(&published).unwrap(), big);

        // B uploads everything into its own version: the published file
        // is never written again.
        let b_id = b.session.unwrap();
        send_chunks(&s, &b_id, index, &big, chunks).await;
        assert_eq!(std::fs::read(&published).unwrap(), big);
        drop(sess_b);
        let committed = commit(
            State(s.clone()),
            Extension(Principal::admin()),
            Path(b_id),
            Bytes::new(),
        )
        .await;
        assert!(committed.is_err_and(|e| e.code == ErrorCode::Unavailable));
        let current = dir.current().unwrap().unwrap();
        assert_ne!(current, a_version);
        assert_eq!(
            std::fs::read(dir.version_path(&current).join("large-0.bin")).unwrap(),
            big
        );
    }

    /// Puts the tree at `src` under `key` through plan, batch and commit
    /// (the metadata server is not there: the record fails, the data is
    /// published); returns the session (its staging version published).
    async fn put_tree(s: &AppState, key: &str, src: &FsPath) -> Arc<PutSession> {
        let m = kt_sync::scan(src, &mut kt_sync::ScanCache::default()).unwrap();
        let header = serde_json::json!({ "key": key, "digest": kt_sync::manifest_digest(&m) });
        let (p, sess) = plan_of(s, &codec::encode_document(&header, &m)).await;
        send_and_commit(s, &p, src, &m).await;
        sess
    }

    async fn send_and_commit(s: &AppState, p: &PutPlan, src: &FsPath, m: &Manifest) {
        let id = p.session.clone().unwrap();
        let items = p
            .needed
            .iter()
            .map(|&i| {
                let e = &m.entries[i as usize];
                kt_sync::batch::SendItem {
                    index: i,
                    path: src.join(&e.path),
                    size: e.size,
                    entry_path: e.path.clone(),
                    data: None,
                    beneath: None,
                }
            })
            .collect();
        let body = Body::from_stream(kt_sync::batch::send_stream(items, None));
        batch(State(s.clone()), Path(id.clone()), body)
            .await
            .unwrap();
        let committed = commit(
            State(s.clone()),
            Extension(Principal::admin()),
            Path(id),
            Bytes::new(),
        )
        .await;
        assert!(committed.is_err_and(|e| e.code == ErrorCode::Unavailable));
    }

    /// What is under `root` by path: each file's content, None for a
    /// directory.
    fn contents(root: &FsPath) -> std::collections::BTreeMap<String, Option<Vec<u8>>> {
        let mut out = std::collections::BTreeMap::new();
        let mut dirs = vec![root.to_owned()];
        while let Some(dir) = dirs.pop() {
            for d in std::fs::read_dir(&dir).unwrap() {
                let p = d.unwrap().path();
                let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_owned();
                if p.is_dir() {
                    dirs.push(p);
                    out.insert(rel, None);
                } else {
                    out.insert(rel, Some(std::fs::read(&p).unwrap()));
                }
            }
        }
        out
    }

    /// A source tree of `n` small files in two directories.
    fn small_tree(src: &FsPath, n: usize) {
        for d in ["a", "b"] {
            std::fs::create_dir_all(src.join(d)).unwrap();
        }
        for i in 0..n {
            let dir = if i % 2 == 0 { "a" } else { "b" };
            std::fs::write(src.join(format!("{dir}/f{i}")), format!("file {i}")).unwrap();
        }
    }

    async fn spare_of(s: &AppState, key: &str) -> Option<String> {
        let state = s.keys.state(&Key::parse(key).unwrap());
        let st = state.lock().await;
        st.spare.as_ref().map(|sp| sp.version.clone())
    }

    fn ino(p: &FsPath) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(p).unwrap().ino()
    }

    /// The version a put supersedes, no reader holding it, is kept; the
    /// next put stages in it (its directory renamed, only what differs
    /// fixed up) and publishes the tree the source has, the version it was
    /// staged against untouched.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_put_stages_in_the_version_it_superseded_two_puts_back() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        small_tree(&src, 40);
        let s = shared(&d.path().join("store"));
        let dir = s.keys.dir_of(&Key::parse("t/r").unwrap());
        let v1 = put_tree(&s, "t/r", &src).await.version.clone();
        assert_eq!(spare_of(&s, "t/r").await, None);
        std::fs::write(src.join("a/f0"), "changed once").unwrap();
        let v2 = put_tree(&s, "t/r", &src).await.version.clone();
        assert_eq!(spare_of(&s, "t/r").await.as_deref(), Some(v1.as_str()));
        let v1_dir = ino(&dir.version_path(&v1));
        let v2_tree = contents(&dir.version_path(&v2));

        std::fs::write(src.join("b/f1"), "changed twice").unwrap();
        std::fs::write(src.join("b/new"), "new").unwrap();
        std::fs::remove_file(src.join("a/f2")).unwrap();
        let m = kt_sync::scan(&src, &mut kt_sync::ScanCache::default()).unwrap();
        let header = serde_json::json!({ "key": "t/r", "digest": kt_sync::manifest_digest(&m) });
        let (p, sess) = plan_of(&s, &codec::encode_document(&header, &m)).await;
        assert_eq!(
            ino(&dir.version_path(&sess.version)),
            v1_dir,
            "not staged in v1"
        );
        assert!(!dir.version_path(&v1).exists());
        assert_eq!(spare_of(&s, "t/r").await, None);
        let sent: Vec<&str> = p
            .needed
            .iter()
            .map(|&i| m.entries[i as usize].path.as_str())
            .collect();
        assert_eq!(sent, ["b/f1", "b/new"]);
        send_and_commit(&s, &p, &src, &m).await;
        let v3 = sess.version.clone();
        assert_eq!(dir.current().unwrap().as_deref(), Some(v3.as_str()));
        assert_eq!(contents(&dir.version_path(&v3)), contents(&src));
        assert_eq!(contents(&dir.version_path(&v2)), v2_tree);
        assert_eq!(spare_of(&s, "t/r").await.as_deref(), Some(v2.as_str()));
    }

    /// A superseded version a reader holds is never a spare: the next put
    /// stages afresh, the reader's version stays whole until it is
    /// closed, then goes.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_version_a_reader_holds_is_never_staged_in() {
        use kt_service::reads::ReadSource;
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        small_tree(&src, 40);
        let s = shared(&d.path().join("store"));
        let key = Key::parse("t/held").unwrap();
        let dir = s.keys.dir_of(&key);
        let v1 = put_tree(&s, "t/held", &src).await.version.clone();
        let source = crate::versions::StoreVersions {
            keys: s.keys.clone(),
            chunk_size: CHUNK,
        };
        let read = source.open(&key).await.unwrap();
        assert_eq!(read.version, v1);
        let held = contents(&dir.version_path(&v1));
        let v1_dir = ino(&dir.version_path(&v1));

        std::fs::write(src.join("a/f0"), "changed once").unwrap();
        put_tree(&s, "t/held", &src).await;
        assert_eq!(spare_of(&s, "t/held").await, None, "v1 is read");
        std::fs::write(src.join("a/f0"), "changed twice").unwrap();
        let v3 = put_tree(&s, "t/held", &src).await;
        assert_ne!(ino(&dir.version_path(&v3.version)), v1_dir);
        assert_eq!(contents(&dir.version_path(&v1)), held);
        assert_eq!(contents(&dir.version_path(&v3.version)), contents(&src));

        source.close(&read).await;
        assert!(!dir.version_path(&v1).exists(), "v1 outlived its reader");
    }

    /// A put whose staging in the spare fails midway (a file to remove is
    /// a directory now) stages afresh and publishes the right tree; one
    /// that crashed midway leaves the current version as it was, the next
    /// start removes what it left, and the next put is right.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_staging_that_fails_or_crashes_midway_leaves_current_and_the_next_put_right() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        let data = d.path().join("store");
        small_tree(&src, 40);
        let s = shared(&data);
        let dir = s.keys.dir_of(&Key::parse("t/crash").unwrap());
        // Each put changes a/f0: the spare's a/f0 is always to be removed.
        let spoil = |v: &str| {
            let p = dir.version_path(v).join("a/f0");
            std::fs::remove_file(&p).unwrap();
            std::fs::create_dir(&p).unwrap();
            std::fs::write(p.join("in-the-way"), b"x").unwrap();
        };
        let v1 = put_tree(&s, "t/crash", &src).await.version.clone();
        std::fs::write(src.join("a/f0"), "2").unwrap();
        let v2 = put_tree(&s, "t/crash", &src).await.version.clone();
        assert_eq!(spare_of(&s, "t/crash").await.as_deref(), Some(v1.as_str()));
        spoil(&v1);

        // A failure midway: staged afresh, published right.
        std::fs::write(src.join("a/f0"), "3").unwrap();
        let v3 = put_tree(&s, "t/crash", &src).await.version.clone();
        assert_eq!(dir.current().unwrap().as_deref(), Some(v3.as_str()));
        assert_eq!(contents(&dir.version_path(&v3)), contents(&src));
        assert!(!dir.version_path(&v1).exists());

        // A crash midway: staging in v2 stopped where it failed.
        assert_eq!(spare_of(&s, "t/crash").await, Some(v2.clone()));
        spoil(&v2);
        let current = contents(&dir.version_path(&v3));
        std::fs::write(src.join("a/f0"), "4").unwrap();
        let m4 = kt_sync::scan(&src, &mut kt_sync::ScanCache::default()).unwrap();
        let state = s.keys.state(&Key::parse("t/crash").unwrap());
        let (spare, base) = {
            let mut st = state.lock().await;
            (st.spare.take().unwrap(), st.current.clone().unwrap())
        };
        let staging = dir.stage().unwrap();
        let base_root = dir.version_path(&base.version);
        let fixed = crate::versions::recycle(
            &dir,
            &staging,
            &spare,
            &m4,
            Some((base_root.as_path(), &*base.meta.manifest)),
        );
        assert!(fixed.is_err(), "{fixed:?}");
        drop((state, s));

        // Restarted.
        let s = shared(&data);
        assert_eq!(dir.current().unwrap().as_deref(), Some(v3.as_str()));
        assert!(!dir.version_path(&staging).exists());
        assert_eq!(contents(&dir.version_path(&v3)), current);
        let v4 = put_tree(&s, "t/crash", &src).await.version.clone();
        assert_eq!(dir.current().unwrap().as_deref(), Some(v4.as_str()));
        assert_eq!(contents(&dir.version_path(&v4)), contents(&src));
    }

    /// A manifest of a directory, a small file and a large one (deferred:
    /// its hash the placeholder).
    fn deferring_manifest() -> Manifest {
        let file = |path: &str, size: u64, hash: Hash| Entry {
            path: path.into(),
            kind: EntryKind::File,
            size,
            mode: 0o644,
            mtime: 1_700_000_000,
            mtime_nsec: 5,
            hash: Some(hash),
            target: None,
        };
        Manifest {
            root: kt_types::RootKind::Dir,
            entries: vec![
                Entry {
                    path: "d".into(),
                    kind: EntryKind::Dir,
                    size: 0,
                    mode: 0o755,
                    mtime: 0,
                    mtime_nsec: 0,
                    hash: None,
                    target: None,
                },
                file("d/big", 3 * CHUNK, DEFERRED_HASH),
                file("d/small", 10, Hash([1; 32])),
                file("d/sized", CHUNK, DEFERRED_HASH),
            ],
        }
    }

    #[test]
    fn deferred_entries_are_files_named_once() {
        let m = deferring_manifest();
        assert_eq!(check_deferred(&m, &[1]).unwrap(), [1]);
        // One the store does not take in chunks (sent in a batch).
        assert_eq!(check_deferred(&m, &[3, 1]).unwrap(), [1, 3]);
        assert!(check_deferred(&m, &[]).unwrap().is_empty());
        for (deferred, says) in [
            (&[1, 1][..], "named twice"),
            (&[9], "out of range"),
            (&[0], "not a regular file"),
            (&[2], "carries a hash"),
        ] {
            let e = check_deferred(&m, deferred).unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidRequest, "{deferred:?}");
            assert!(e.message.contains(says), "{deferred:?}: {}", e.message);
        }
        // A real hash where the placeholder belongs.
        let mut hashed = m.clone();
        hashed.entries[1].hash = Some(Hash([2; 32]));
        let e = check_deferred(&hashed, &[1]).unwrap_err();
        assert!(e.message.contains("carries a hash"), "{}", e.message);
    }

    #[test]
    fn a_deferred_file_like_the_base_ones_is_hashed_first() {
        let m = deferring_manifest();
        let mut base = m.clone();
        base.entries[1].hash = Some(Hash([3; 32]));
        assert_eq!(like_in_base(&m, &[1], &base), [1]);
        // Another mtime or size: changed, sent whole.
        base.entries[1].mtime_nsec = 6;
        assert!(like_in_base(&m, &[1], &base).is_empty());
        base.entries[1].mtime_nsec = 5;
        base.entries[1].size += 1;
        assert!(like_in_base(&m, &[1], &base).is_empty());
        base.entries.remove(1);
        assert!(like_in_base(&m, &[1], &base).is_empty());
    }

    #[test]
    fn roots_patch_the_manifest_into_the_one_a_hashed_put_sends() {
        let m = deferring_manifest();
        let real = Hash([4; 32]);
        let sent = [DeferredRoot {
            index: 1,
            hash: real,
        }];
        let patched = patch_roots(&m, &[1], &sent, |_| Some(real))
            .unwrap()
            .unwrap();
        let mut want = m.clone();
        want.entries[1].hash = Some(real);
        assert_eq!(patched, want);
        assert_eq!(
            kt_sync::manifest_digest(&patched),
            kt_sync::manifest_digest(&want)
        );
        // Nothing deferred: nothing patched.
        assert_eq!(patch_roots(&m, &[], &[], |_| None).unwrap(), None);
        // The content received is not what the client read.
        let e = patch_roots(&m, &[1], &sent, |_| Some(Hash([5; 32]))).unwrap_err();
        assert_eq!(e.code, ErrorCode::HashMismatch);
        assert!(e.message.contains("nothing is published"), "{}", e.message);
        // A root missing, repeated, or for an entry not deferred.
        let e = patch_roots(&m, &[1], &[], |_| Some(real)).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidRequest);
        assert!(
            e.message.contains("commit without the root"),
            "{}",
            e.message
        );
        let twice = [sent[0], sent[0]];
        let e = patch_roots(&m, &[1], &twice, |_| Some(real)).unwrap_err();
        assert!(e.message.contains("sent twice"), "{}", e.message);
        let other = [DeferredRoot {
            index: 2,
            hash: real,
        }];
        let e = patch_roots(&m, &[1], &other, |_| Some(real)).unwrap_err();
        assert!(e.message.contains("did not defer"), "{}", e.message);
    }
}
