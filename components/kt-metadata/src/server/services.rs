//! Services: teardown (`DELETE /api/v1/services/{name}`).

use axum::extract::{Extension, Path, State};
use kt_service::{ApiError, ApiJson, forbidden};
use kt_types::api::TeardownResponse;
use kt_types::auth::Principal;

use super::agents::commit_eviction;
use super::keys::delete_one;
use super::{AppState, check_service, db_err};
use crate::db::Batch;

/// `DELETE /api/v1/services/{name}`: evicts the service's agents and deletes
/// its `resource` keys, its base path but for `lifespan=cluster` keys, and
/// its zero-copy data ([`Registry::teardown_plan`](crate::registry::Registry::teardown_plan)). Run again after a
/// partial failure: it is idempotent.
pub(super) async fn teardown(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(name): Path<String>,
) -> Result<ApiJson<TeardownResponse>, ApiError> {
    if !who.serves(&name) {
        return Err(forbidden(format!(
            "this token may not tear down service {name:?} (not one of its services)"
        )));
    }
    teardown_service(&s, &name).await.map(ApiJson)
}

/// Evicts a service's agents for good and deletes what its lifespan rule
/// ties to it ([`Registry::teardown_plan`](crate::registry::Registry::teardown_plan)). The name is a service's from
/// then on (its base path stays its own).
pub(super) async fn teardown_service(
    s: &AppState,
    name: &str,
) -> Result<TeardownResponse, ApiError> {
    check_service(Some(name))?;
    // Agents first, so none is handed out as a source while keys go.
    let (targets, evicted) = {
        let mut registry = s.registry.lock().await;
        let (targets, agents) = registry.teardown_plan(name);
        let new = registry.know_services([name]);
        s.db.write(&Batch {
            put_services: new,
            ..Batch::default()
        })
        .map_err(db_err)?;
        let eviction = registry.retire(&agents);
        commit_eviction(s, &eviction, "service torn down").map_err(db_err)?;
        (targets, eviction.agents)
    };
    let mut deleted = Vec::new();
    let mut failed = Vec::new();
    for r in targets {
        match delete_one(s, &r).await {
            Ok(()) => deleted.push(r.key),
            Err(e) => failed.push(e),
        }
    }
    if let Some(first) = failed.first() {
        return Err(ApiError::new(
            first.code,
            format!(
                "teardown of service {name} incomplete: {} key(s) deleted, {} not ({}); run it again",
                deleted.len(),
                failed.len(),
                first.message
            ),
        ));
    }
    tracing::info!(service = %name, keys = deleted.len(), agents = evicted.len(), "service torn down");
    Ok(TeardownResponse { deleted, evicted })
}
