//! Upload sessions: plan → batch stream and chunks → commit (or abort).
//!
//! A put may defer the hashes of files ([`PutRequest::deferred`][kt_types::api::PutRequest::deferred]):
//! their manifest entries carry [`DEFERRED_HASH`][kt_types::api::DEFERRED_HASH] and the digest planned
//! with is provisional. [`plan`] checks them (`check_deferred`), asks the
//! client to hash first those the current version probably has
//! (`like_in_base`), and needs the others whole; [`chunk`] keeps the root
//! a large one's chunks merge into instead of checking it, [`batch`] the
//! hash of a small one as received; [`commit`] compares each
//! with the root the client sends ([`CommitRequest`][kt_types::api::CommitRequest]) and publishes the
//! manifest with the real hashes (`patch_roots`), whose digest is the
//! one a put that hashed first makes. Any mismatch discards the upload.
//! The whole protocol: `docs/sync-protocol.md`, "deferred hashes".
//!
//! The files, one stage of a session each:
//!
//! - `plan`: `POST /api/v1/puts`: parses and checks the put document
//!   (key, rights, manifest, deferred entries), stages the tree in a fresh
//!   version (in the spare one if the key has one) or adopts the one a
//!   restart interrupted, and opens the session. Everything up to the
//!   session's creation runs under the key's lock; a staging version is
//!   claimed there and held by one session until it ends;
//! - `room`: admission by free space: a put that cannot fit (less the
//!   reserve and what sessions in progress were promised) is refused when
//!   planned, not when its last byte arrives;
//! - `receive`: the bytes: the batch stream of small files and each chunk
//!   of a large one, written into the session's staging version; a file
//!   is finished (checked against its hash, or its root kept when
//!   deferred) once all of it is in. A corrupt stream or a hash mismatch
//!   ends the session;
//! - `commit`: completeness, the deferred roots, then the publish: the
//!   staged tree is finished, its description written and `current`
//!   switched by an atomic symlink swap under the key's lock, which stays
//!   held until the metadata server has the record (records of one key
//!   arrive in publish order);
//! - `seed`: the chunks of a changed large file that the current
//!   version's file of the same path and size already has, copied from
//!   it when the plan is made (the client sent its chunks' values), so
//!   only changed chunks move;
//! - `end`: how a session ends without publishing: abort, expiry (the
//!   sweep, which also removes interrupted uploads no put resumed) and
//!   shutdown (sessions dropped, staging versions kept for resuming).
//!
//! This file holds what several stages share: the session lookup and the
//! owner check a plan and a commit both make. Stages call each other only
//! through `pub(super)` items; the router sees the handlers re-exported
//! here.

use std::sync::Arc;

use kt_service::ApiError;
use kt_types::Key;

use crate::session::PutSession;
use crate::state::Shared;

mod commit;
mod end;
mod plan;
mod receive;
mod room;
mod seed;
#[cfg(test)]
mod tests;

pub use commit::commit;
pub use end::{abort, interrupt_all, sweep};
pub use plan::plan;
pub use receive::{batch, chunk};
pub(crate) use room::free_space;

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
