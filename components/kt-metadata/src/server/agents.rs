//! Node agents: heartbeats (`POST /api/v1/agents`), the list, evictions.

use axum::extract::{Extension, State};
use kt_service::{ApiError, ApiJson, forbidden};
use kt_types::api::{AgentHeartbeat, AgentList, HeartbeatReply};
use kt_types::auth::Principal;

use super::{
    AppState, Inner, check_agent_id, check_service, check_url, db_err, note_services, now_ms,
};
use crate::db::{Batch, DbError};
use crate::registry::Eviction;

pub(super) async fn heartbeat(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiJson(hb): ApiJson<AgentHeartbeat>,
) -> Result<ApiJson<HeartbeatReply>, ApiError> {
    check_agent_id(&hb.id)?;
    if !who.is_agent(&hb.id) {
        return Err(forbidden(format!(
            "this agent token is {:?}'s, not {:?}'s",
            who.name.as_deref().unwrap_or_default(),
            hb.id
        )));
    }
    check_url("agent url", &hb.url)?;
    if !who.may_advertise(&hb.url) {
        return Err(forbidden(format!(
            "this pod's token may announce its agent on its own IP only, not {:?}",
            hb.url
        )));
    }
    check_service(hb.service.as_deref())?;
    // Announcing a service makes it known, and a known service owns the
    // keys under its name (only its writers write there): a token may
    // announce only a service it writes (review B4), as a put may name one.
    if let Some(service) = hb.service.as_deref().filter(|s| !who.serves(s)) {
        return Err(forbidden(format!(
            "this token may not announce service {service:?} (not one of its services)"
        )));
    }
    let id = hb.id.clone();
    let mut registry = s.registry.lock().await;
    // An agent is a peer only of what its token may read: a copy of
    // another service's key it claims to serve is dropped.
    let mut services = note_services(&mut registry, &who);
    services.extend(registry.know_services(hb.service.as_deref()));
    let beat = registry.heartbeat_reading(hb, now_ms(), |key, service| {
        who.refuses_read(key, service).is_none()
    });
    if let Some(a) = &beat.agent {
        tracing::info!(agent = %a.id, url = %a.url, service = ?a.service, "agent announced");
    }
    let changed = beat.changed.len();
    s.db.write(&Batch {
        put_records: beat.changed,
        put_agents: beat.agent.into_iter().collect(),
        put_services: services,
        ..Batch::default()
    })
    .map_err(db_err)?;
    drop(registry);
    if changed > 0 || !beat.drop.is_empty() {
        tracing::debug!(agent = %id, changed, dropped = beat.drop.len(), "agent reconciled");
    }
    Ok(ApiJson(HeartbeatReply {
        interval_ms: s.heartbeat_interval_ms,
        ttl_ms: s.agent_ttl_ms,
        drop: beat.drop,
        capability_keys: s.signer.public_keys(),
    }))
}

pub(super) async fn list_agents(State(s): State<AppState>) -> ApiJson<AgentList> {
    let agents = s.registry.lock().await.agents(now_ms());
    ApiJson(AgentList { agents })
}

/// Removes agents and their peer entries, committing the change.
pub(super) fn commit_eviction(s: &Inner, e: &Eviction, why: &str) -> Result<(), DbError> {
    for id in &e.agents {
        tracing::info!(agent = %id, why, "agent evicted");
    }
    s.db.write(&Batch {
        put_records: e.changed.clone(),
        remove_agents: e.agents.clone(),
        ..Batch::default()
    })
}
