//! Source leases: granted by `POST /api/v1/keys/{key}/lease`, renewed,
//! released and reported failed under `/api/v1/leases`; and tensor grants
//! (`POST /api/v1/tensors/grants/{key}`), the capability a getter's agent
//! shows a key's holder to open a point-to-point tensor session there.

use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use kt_service::{ApiError, ApiJson, forbidden};
use kt_types::api::{LeaseInfo, LeaseList, LeaseRequest, SourceFailure, SourceLease};
use kt_types::auth::{Principal, Role};
use kt_types::tensor::{TensorGrant, TensorGrantRequest};
use kt_types::{Key, STORE_HOLDER};

use super::{AppState, Inner, check_agent_id, db_err, now_ms};

/// Source leases: `POST /api/v1/keys/{key}/lease` (the only POST under `/keys`).
pub(super) async fn lease_key(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(path): Path<String>,
    ApiJson(req): ApiJson<LeaseRequest>,
) -> Result<ApiJson<SourceLease>, ApiError> {
    let Some(key) = path.strip_suffix("/lease") else {
        return Err(ApiError::not_found("no such route"));
    };
    let key = Key::parse(key)?;
    let now = now_ms();
    let sources = readable_sources(&s, &who, &key, &req, now).await?;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let lease = s
        .leases
        .lock()
        .await
        .grant(
            id,
            (key, who.clone()),
            &sources.candidates,
            now,
            s.lease_ttl_ms,
        )
        .ok_or_else(|| ApiError::internal("a key with sources yielded no lease"))?;
    let getter = req.getter.as_deref().or(who.name.as_deref());
    let capability = s.capability_for(&lease.key, &lease.source, getter, now);
    Ok(ApiJson(SourceLease {
        lease: lease.id,
        source: lease.source,
        ttl_ms: s.lease_ttl_ms,
        record: sources.record,
        capability,
    }))
}

impl Inner {
    /// What a getter shows `source` to read `key` there: a capability for
    /// an agent; nothing for the store, which is shown the getter's token.
    pub(super) fn capability_for(
        &self,
        key: &Key,
        source: &kt_types::Source,
        getter: Option<&str>,
        now: u64,
    ) -> Option<String> {
        (source.id != STORE_HOLDER).then(|| {
            let scope = kt_types::auth::Scope {
                key: key.clone(),
                version: source.version.clone(),
            };
            self.signer
                .mint(scope, &source.id, getter.unwrap_or("workload"), now)
        })
    }
}

/// `POST /api/v1/tensors/grants/{key}`: the record of a key of tensors and
/// a capability for its version at its holder, minted for the caller's own
/// agent (bound to its pod's IP when its token is), so that the getter's
/// agent shows the holder that and never its bearer token: a holder is a
/// peer, and may be a listener a pod registered to collect tokens.
pub(super) async fn tensor_grant(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(key): Path<String>,
    ApiJson(req): ApiJson<TensorGrantRequest>,
) -> Result<ApiJson<TensorGrant>, ApiError> {
    let key = Key::parse(&key)?;
    if !who.is_agent(&req.getter) {
        return Err(forbidden(format!(
            "this token asks for tensor grants for its own agent only, not {:?}",
            req.getter
        )));
    }
    let now = now_ms();
    let record = {
        let registry = s.registry.lock().await;
        // Refused first: a key the caller may not read is not described.
        if let Some(r) = registry.get_unexpired(&key, now) {
            kt_service::check_read(&who, &key, &r.service)?;
        }
        registry.served(&key, now)?.clone()
    };
    if record.tensors.is_none() || record.holder == STORE_HOLDER {
        return Err(ApiError::bad_request(format!(
            "{key} holds files, not tensors (`kt get` fetches it)"
        )));
    }
    let capability = (record.holder != req.getter).then(|| {
        let scope = kt_types::auth::Scope {
            key: key.clone(),
            version: record.version.clone(),
        };
        s.signer
            .mint_bound(scope, &record.holder, &req.getter, who.ip, now)
    });
    Ok(ApiJson(TensorGrant { record, capability }))
}

/// The live sources of `key` for `who`, refused first (before anything of
/// its sources is told) when its token may not read the key's service.
pub(super) async fn readable_sources(
    s: &AppState,
    who: &Principal,
    key: &Key,
    req: &LeaseRequest,
    now: u64,
) -> Result<crate::registry::Sources, ApiError> {
    let store_registered = s.store_url.lock().await.is_some();
    let registry = s.registry.lock().await;
    if let Some(r) = registry.get_unexpired(key, now) {
        kt_service::check_read(who, key, &r.service)?;
    }
    Ok(registry.sources(key, req, store_registered, now)?)
}

fn unknown_lease(id: &str) -> ApiError {
    ApiError::not_found(format!("lease {id} not found (released or expired)"))
}

pub(super) async fn renew_lease(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<ApiJson<LeaseInfo>, ApiError> {
    let now = now_ms();
    let lease = s.leases.lock().await.renew(&id, now, s.lease_ttl_ms);
    lease
        .map(|l| ApiJson(l.info(now)))
        .ok_or_else(|| unknown_lease(&id))
}

pub(super) async fn release_lease(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let lease = s.leases.lock().await.release(&id, now_ms());
    lease
        .map(|_| StatusCode::NO_CONTENT)
        .ok_or_else(|| unknown_lease(&id))
}

/// Ends the lease; a peer that failed a getter stops being offered for that
/// key (its next heartbeat adds it back if it still serves the version). An
/// origin is only released: the getter excludes it from its next request.
pub(super) async fn lease_failed(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    ApiJson(failure): ApiJson<SourceFailure>,
) -> Result<StatusCode, ApiError> {
    let released = {
        let mut leases = s.leases.lock().await;
        match leases.get(&id, now_ms()) {
            Some(l) if l.getter != who && who.role != Role::Admin => {
                return Err(forbidden(format!(
                    "lease {id} is another getter's: only the getter it was granted to reports its source"
                )));
            }
            Some(_) => leases.release(&id, now_ms()),
            None => None,
        }
    };
    // A lease this server no longer knows (it restarted, or the lease
    // expired) is reported by key and source instead; nobody can tell
    // whose it was, so it drops no peer (an admin's report aside).
    let (key, source, url, known) = match (released, failure.key, failure.source) {
        (Some(l), _, _) => (l.key, l.source.id, l.source.url, true),
        (None, Some(key), Some(source)) => {
            check_agent_or_store(&source)?;
            (key, source, String::new(), who.role == Role::Admin)
        }
        (None, _, _) => return Err(unknown_lease(&id)),
    };
    // The reason is the getter's text: bounded, and logged escaped.
    let reason: String = failure.reason.chars().take(MAX_REASON).collect();
    tracing::warn!(
        %key,
        %source,
        %url,
        reason = ?reason,
        transient = failure.transient,
        "a source failed a getter"
    );
    if failure.transient || !known {
        return Ok(StatusCode::NO_CONTENT);
    }
    let mut registry = s.registry.lock().await;
    if let Some(record) = registry.remove_peer(&key, &source) {
        s.db.put_record(&record).map_err(db_err)?;
        tracing::info!(%key, peer = %source, "peer no longer offered");
    }
    Ok(StatusCode::NO_CONTENT)
}

/// The most of a failure report's reason that is logged, in characters.
const MAX_REASON: usize = 512;

/// A source id in a failure report: the store or an agent id.
fn check_agent_or_store(id: &str) -> Result<(), ApiError> {
    if id == kt_types::STORE_HOLDER {
        return Ok(());
    }
    check_agent_id(id)
}

pub(super) async fn list_leases(State(s): State<AppState>) -> ApiJson<LeaseList> {
    let leases = s.leases.lock().await.list(now_ms());
    ApiJson(LeaseList { leases })
}
