//! The tensor service's HTTP route: the source side of a point-to-point
//! session, behind the agent's bearer token.

use std::sync::Arc;

use axum::extract::State;
use axum::routing::post;
use kt_service::ApiError;
use kt_types::tensor::{SessionReply, SessionRequest};

use super::Tensors;

/// `POST /api/v1/tensors/sessions`.
pub fn routes(tensors: Arc<Tensors>) -> axum::Router {
    // Another pod's agent asks (the getter's side of a session).
    let agents = &[kt_types::auth::Role::Agent];
    axum::Router::new()
        .route(
            "/api/v1/tensors/sessions",
            kt_service::allow(agents, post(session)),
        )
        .with_state(tensors)
}

async fn session(
    State(t): State<Arc<Tensors>>,
    axum::Extension(who): axum::Extension<kt_types::auth::Principal>,
    axum::Json(req): axum::Json<SessionRequest>,
) -> Result<axum::Json<SessionReply>, ApiError> {
    // A pod's token that reads only some services gets only their tensors.
    for k in &req.keys {
        kt_service::reads::check_owner(t.metadata(), &who, &k.key).await?;
    }
    t.open_session(req).await.map(axum::Json)
}
