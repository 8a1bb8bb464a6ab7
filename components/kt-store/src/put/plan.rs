//! `POST /api/v1/puts`: the put document checked and its tree staged.
//!
//! Invariants: the key, the caller's rights over it and the manifest
//! (digest, limits, deferred entries) are checked before anything is
//! written; an unchanged tree publishes nothing (its record is refreshed
//! under the key's lock); the staging version, fresh, recycled from the
//! spare or adopted from an interrupted upload, is claimed under the key's
//! lock so that no two sessions ever write one version; a plan that fails
//! after staging removes what it staged.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use axum::extract::State;
use kt_service::{ApiBytes, ApiError, ApiJson};
use kt_sync::SyncError;
use kt_sync::apply::{ChunkedFile, WriteMode};
use kt_sync::batch::Expected;
use kt_sync::chunk::ChunkAssembly;
use kt_types::api::{DEFERRED_HASH, HaveChunks, PutPlan, PutRequest};
use kt_types::codec;
use kt_types::{EntryKind, ErrorCode, Hash, Key, Manifest};

use crate::keys::{Published, VersionMeta};
use crate::session::{ChunkSlot, PutSession};
use crate::state::{AppState, blocking, sync_err};
use crate::versions::remove_versions;

use super::end::drop_staging;
use super::receive::complete;
use super::refuse_foreign_owner;
use super::room::{free_space, room_for};

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
    #[serde(default)]
    chunks: Vec<kt_types::api::ChunkValues>,
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
        chunks: head.chunks,
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
        return Ok(ApiJson(no_session(s.cfg.chunk_size)));
    }
    if encoded.is_empty() {
        return Ok(ApiJson(PutPlan {
            need_manifest: true,
            ..no_session(s.cfg.chunk_size)
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
    // A deferred file the current version probably has (same path and
    // size) is better hashed by the client than sent whole.
    if let Some(cur) = st.current.as_ref() {
        let hash_first = like_in_base(&manifest, &deferred, &cur.meta.manifest);
        if !hash_first.is_empty() {
            return Ok(ApiJson(PutPlan {
                deferred: true,
                hash_first,
                ..no_session(s.cfg.chunk_size)
            }));
        }
    }
    let dir = s.keys.dir_of(&key);
    let base = st.current.clone();
    // Where a changed large file's unchanged chunks may be copied from.
    let like_base: Option<super::seed::Base> = st
        .current
        .as_ref()
        .map(|c| (dir.version_path(&c.version), c.meta.manifest.clone()));
    // The client's chunk values by entry (one lookup per needed file; a
    // repeated index keeps the last).
    let sent_chunks: std::collections::HashMap<u32, &kt_types::api::ChunkValues> =
        req.chunks.iter().map(|v| (v.index, v)).collect();
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
    let mut seeds = Vec::new();
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
            if kept.is_none() && !slot.deferred {
                seeds.extend(super::seed::like(
                    &manifest,
                    i,
                    &sent_chunks,
                    like_base.as_ref(),
                    s.cfg.chunk_size,
                    &slot,
                ));
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
    // A changed file's chunks the base version has are copied, not sent.
    let manifest = Arc::new(manifest);
    let (log, seeded, seeded_bytes) = if seeds.is_empty() {
        (log, Vec::new(), 0)
    } else {
        let seeded = super::seed::from_base(seeds, s.cfg.chunk_size, log, manifest.clone()).await;
        match seeded {
            Ok(seeded) => seeded,
            Err(err) => {
                let _ = dir.remove_version(&version);
                return Err(err);
            }
        }
    };
    have.extend(seeded);
    bytes_needed -= seeded_bytes;
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
            manifest,
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
/// A plan that opens no session: nothing to send (the tree is unchanged),
/// or a question for the client first (the manifest, hashes of deferred files).
fn no_session(chunk_size: u64) -> PutPlan {
    PutPlan {
        session: None,
        needed: Vec::new(),
        chunk_size,
        need_manifest: false,
        have: Vec::new(),
        deferred: false,
        hash_first: Vec::new(),
    }
}

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

/// The `deferred` entries of `m` that `base` has a file like (same path
/// and size): probably unchanged, cheaper hashed than sent. The mtime
/// does not count: a `touch`, or a checkout or copy that wrote the same
/// bytes again, changes only it (and the scan cache then misses). One
/// that did change is needed once hashed, and only its chunks whose
/// values differ from the base file's move (`seed`).
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
                    b.kind == EntryKind::File && b.size == e.size
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::put::tests::deferring_manifest;

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
        // Another mtime (touched): still hashed first.
        base.entries[1].mtime_nsec = 6;
        base.entries[1].mtime += 60;
        assert_eq!(like_in_base(&m, &[1], &base), [1]);
        // Another size: changed, sent whole.
        base.entries[1].size += 1;
        assert!(like_in_base(&m, &[1], &base).is_empty());
        base.entries.remove(1);
        assert!(like_in_base(&m, &[1], &base).is_empty());
    }
}
