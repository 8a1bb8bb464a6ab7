//! `POST /api/v1/puts/{session}/commit`: an upload checked and published.
//!
//! Invariants: an incomplete upload, or one whose deferred roots are
//! missing or repeated, keeps its session (the client may finish it); a
//! root that differs from what was received discards the upload and
//! publishes nothing; the publish finishes the staged tree and writes its
//! description before the atomic switch of `current`, which happens
//! under the key's lock after the owner is checked again; that lock is
//! held until the metadata server has the record.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, State};
use kt_service::{ApiError, ApiJson};
use kt_sync::SyncError;
use kt_sync::apply;
use kt_types::api::{CommitRequest, CommitResponse, DeferredRoot};
use kt_types::{Entry, ErrorCode, Hash, Manifest};

use crate::keys::{Published, VersionMeta};
use crate::session::PutSession;
use crate::state::{AppState, Shared, blocking};
use crate::versions::remove_versions;

use super::end::discard;
use super::refuse_foreign_owner;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::put::tests::deferring_manifest;

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
