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
    check_caller(&who, &req)?;
    // A pod's token that reads only some services gets only their tensors.
    for k in &req.keys {
        kt_service::reads::check_owner(t.metadata(), &who, &k.key).await?;
    }
    t.open_session(req).await.map(axum::Json)
}

/// The session names the getter's agent and pod IP: the source keeps the
/// communicator under that agent's pair and connects to that IP. An agent's
/// token speaks for its own agent, on its own pod's IP, only.
fn check_caller(who: &kt_types::auth::Principal, req: &SessionRequest) -> Result<(), ApiError> {
    if !who.is_agent(&req.agent) {
        return Err(kt_service::forbidden(format!(
            "this token may open a tensor session as its own agent only, not {:?}",
            req.agent
        )));
    }
    if let Some(ip) = who.ip
        && req.ip.parse::<std::net::IpAddr>().ok() != Some(ip)
    {
        return Err(kt_service::forbidden(format!(
            "this token is bound to {ip}: a session for {:?} is not its own",
            req.ip
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use kt_types::auth::{Principal, Role};

    use super::*;

    fn request(agent: &str, ip: &str) -> SessionRequest {
        serde_json::from_value(serde_json::json!({
            "keys": [], "agent": agent, "ip": ip, "endpoint": "x", "backend": "host",
        }))
        .expect("a session request")
    }

    #[test]
    fn a_session_is_opened_only_for_the_callers_own_agent_and_ip() {
        let mut a = Principal::admin();
        a.role = Role::Agent;
        a.name = Some("agent-a".into());
        a.ip = Some("10.0.0.7".parse().unwrap());
        assert!(check_caller(&a, &request("agent-a", "10.0.0.7")).is_ok());
        let other = check_caller(&a, &request("agent-b", "10.0.0.7")).unwrap_err();
        assert_eq!(other.code, kt_types::ErrorCode::Forbidden, "{other:?}");
        assert!(other.message.contains("agent-b"), "{other:?}");
        let elsewhere = check_caller(&a, &request("agent-a", "10.0.0.8")).unwrap_err();
        assert_eq!(elsewhere.code, kt_types::ErrorCode::Forbidden);
        // An admin (the testbed's runner) may ask for any.
        assert!(check_caller(&Principal::admin(), &request("agent-b", "10.0.0.8")).is_ok());
    }
}
