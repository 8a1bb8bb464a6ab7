//! Keeping the metadata server's records in step with the store's keys:
//! at start (every key) and every few seconds (keys whose registration
//! failed).
//!
//! A registration made late (a retry, or the start-up pass) is conditional
//! ([`kt_types::api::RegisterIf::AbsentOrHeld`]): it records the version the
//! store holds *now*, under the key's lock, and only if nothing happened to
//! the key at the metadata server meanwhile. If something did (a
//! `locale=local` put took the key over, or it was deleted), the store's
//! copy is no one's any more and is removed. A put that reports success was
//! registered unconditionally at its commit; these rules only decide the
//! fate of publishes whose client was told the record failed.

use kt_api::CallError;
use kt_types::{ErrorCode, Key, STORE_HOLDER};

use crate::state::Shared;

/// What became of one key.
#[derive(Debug, PartialEq, Eq)]
pub enum Settled {
    /// The metadata server records the store's current version.
    Recorded,
    /// The key moved on at the metadata server; the store's copy was removed.
    Removed,
    /// The store no longer holds the key.
    Gone,
    /// The metadata server could not be asked; retried later.
    Pending,
}

/// Registers every key the metadata server lacks or knows at another
/// version (at start, after the store announced itself).
pub async fn all_keys(s: &Shared) {
    for (key, _) in s.keys.all() {
        settle(s, &key, true).await;
    }
}

/// Retries the registrations that failed earlier.
pub async fn retry_pending(s: &Shared) {
    for key in s.registrar.pending().await {
        if settle(s, &key, false).await == Settled::Recorded {
            tracing::info!(%key, "pending registration recorded");
        }
    }
}

/// Brings one key's record in step with the store, `ask_first`: read the
/// record before writing it (the start-up pass, where most are up to date).
pub async fn settle(s: &Shared, key: &Key, ask_first: bool) -> Settled {
    let Some(state) = s.keys.existing(key) else {
        s.registrar.forget(key).await;
        return Settled::Gone;
    };
    let mut st = state.lock().await;
    let Some(cur) = st.current.clone() else {
        s.registrar.forget(key).await;
        return Settled::Gone;
    };
    let reg = s.registration(&cur);
    if ask_first {
        match s.registrar.record(key).await {
            Ok(rec)
                if rec.holder == STORE_HOLDER
                    && rec.version == reg.version
                    && rec.source == reg.source =>
            {
                s.registrar.forget(key).await;
                return Settled::Recorded;
            }
            // Held by an agent, or another version: the conditional
            // registration below decides.
            Ok(_) => {}
            Err(e) if e.code() == ErrorCode::NotFound => {}
            Err(e) => return pending(s, key, &e).await,
        }
    }
    match s.registrar.register_if_unchanged(key, reg).await {
        Ok(_) => {
            s.registrar.forget(key).await;
            Settled::Recorded
        }
        Err(e) if e.code() == ErrorCode::Conflict => match s.remove_key(key, &mut st).await {
            Ok(()) => {
                tracing::info!(%key, version = %cur.version, reason = %e, "store copy removed: the key moved on at the metadata server");
                Settled::Removed
            }
            Err(re) => {
                tracing::warn!(%key, error = %re, "could not remove a store copy the metadata server no longer names");
                Settled::Pending
            }
        },
        Err(e) => pending(s, key, &e).await,
    }
}

async fn pending(s: &Shared, key: &Key, e: &CallError) -> Settled {
    tracing::warn!(%key, error = %e, "could not register key; will retry");
    s.registrar.mark_pending(key).await;
    Settled::Pending
}
