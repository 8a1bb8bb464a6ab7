//! The tensor service's HTTP route: the source side of a point-to-point
//! session. A getter's agent shows capabilities the metadata server minted
//! for its keys (`kt_service::capability`), never its bearer token; an
//! agent's or pod's own token is accepted too (the roles table's `agent`),
//! as its own agent only.

use std::sync::Arc;

use axum::extract::State;
use axum::routing::post;
use kt_service::ApiError;
use kt_service::capability::{Refused, Verifier};
use kt_types::ErrorCode;
use kt_types::auth::Principal;
use kt_types::tensor::{SessionReply, SessionRequest};

use super::Tensors;

/// `POST /api/v1/tensors/sessions`; `capabilities` checks what getters show
/// (the keys come with the agent's heartbeats).
pub fn routes(tensors: Arc<Tensors>, capabilities: Arc<Verifier>) -> axum::Router {
    // Another pod's agent asks (the getter's side of a session): a
    // capability's bearer is a workload reading one key; an agent's token
    // passes as its own agent.
    let callers = &[kt_types::auth::Role::Agent, kt_types::auth::Role::Workload];
    axum::Router::new()
        .route(
            "/api/v1/tensors/sessions",
            kt_service::allow(callers, post(session)),
        )
        .with_state((tensors, capabilities))
}

async fn session(
    State((t, capabilities)): State<(Arc<Tensors>, Arc<Verifier>)>,
    axum::Extension(who): axum::Extension<Principal>,
    axum::Json(req): axum::Json<SessionRequest>,
) -> Result<axum::Json<SessionReply>, ApiError> {
    if who.scope.is_some() {
        // The metadata server checked the reads when it minted them.
        check_capabilities(&capabilities, &who, &req, now_ms())?;
    } else {
        check_caller(&who, &req)?;
        // A pod's token that reads only some services gets only their tensors.
        for k in &req.keys {
            kt_service::reads::check_owner(t.metadata(), &who, &k.key).await?;
        }
    }
    t.open_session(req).await.map(axum::Json)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A session whose caller shows a capability: every key comes with its own
/// (`SessionRequest::capabilities`, in the order of `keys`), signed for
/// this agent (`verifier`), reading that key's version, minted for the
/// agent the session names and (when bound) its IP; the one shown as bearer
/// is among them. A capability is worth its one key: one key's cannot open
/// a session of others.
fn check_capabilities(
    verifier: &Verifier,
    who: &Principal,
    req: &SessionRequest,
    now_ms: u64,
) -> Result<(), ApiError> {
    if req.capabilities.len() != req.keys.len() {
        return Err(kt_service::forbidden(format!(
            "a session shown capabilities brings one per key (`capabilities`, in the order of \
             `keys`): {} for {} keys",
            req.capabilities.len(),
            req.keys.len()
        )));
    }
    let mut bearer_among = false;
    for (want, presented) in req.keys.iter().zip(&req.capabilities) {
        let cap = verifier.verify(presented, now_ms).map_err(|e| match e {
            // Soon mended (this agent's next heartbeat): tried again.
            Refused::UnknownKey(_) => ApiError::new(ErrorCode::Unavailable, e.to_string()),
            Refused::Invalid(why) => {
                kt_service::forbidden(format!("the capability for {}: {why}", want.key))
            }
        })?;
        if cap.scope.key != want.key || cap.scope.version != want.version {
            return Err(kt_service::forbidden(format!(
                "the capability for {} at version {:?} reads {} at {:?}",
                want.key, want.version, cap.scope.key, cap.scope.version
            )));
        }
        if cap.getter != req.agent {
            return Err(kt_service::forbidden(format!(
                "the capability for {} was minted for agent {:?}, not {:?}",
                want.key, cap.getter, req.agent
            )));
        }
        if let Some(ip) = cap.ip
            && req.ip.parse::<std::net::IpAddr>().ok() != Some(ip)
        {
            return Err(kt_service::forbidden(format!(
                "the capability for {} is bound to {ip}: a session for {:?} is not its getter's",
                want.key, req.ip
            )));
        }
        bearer_among |= who.scope.as_ref() == Some(&cap.scope);
    }
    if !bearer_among {
        return Err(kt_service::forbidden(
            "the capability shown as bearer is for none of the session's keys",
        ));
    }
    Ok(())
}

/// The session names the getter's agent and pod IP: the source keeps the
/// communicator under that agent's pair and connects to that IP. An agent's
/// token speaks for its own agent, on its own pod's IP, only (a workload's
/// token, which is no agent, is refused).
fn check_caller(who: &Principal, req: &SessionRequest) -> Result<(), ApiError> {
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

    /// A session of `keys` (at version v1) for `agent` on `ip`, showing
    /// `caps`.
    fn shown(agent: &str, ip: &str, keys: &[&str], caps: &[&str]) -> SessionRequest {
        let keys: Vec<_> = keys
            .iter()
            .map(|k| serde_json::json!({ "key": k, "version": "v1", "tensors": [] }))
            .collect();
        serde_json::from_value(serde_json::json!({
            "keys": keys, "agent": agent, "ip": ip, "endpoint": "x", "backend": "host",
            "capabilities": caps,
        }))
        .expect("a session request")
    }

    #[test]
    fn a_session_shown_capabilities_moves_only_their_keys_to_their_getter() {
        use kt_service::capability::Signer;
        use kt_types::auth::Scope;
        let signer = Signer::ephemeral(1_000).unwrap();
        let verifier = Verifier::new("pod-src");
        verifier.set_keys(&signer.public_keys());
        let scope = |k: &str| Scope {
            key: kt_types::Key::parse(k).unwrap(),
            version: "v1".into(),
        };
        let ip = Some("10.0.0.7".parse().unwrap());
        let mint =
            |k: &str, getter: &str| signer.mint_bound(scope(k), "pod-src", getter, ip, 1_000);
        // Who the auth layer says the bearer of a capability for `k` is.
        let bearer = |k: &str| {
            kt_types::auth::Capability {
                scope: scope(k),
                source: "pod-src".into(),
                getter: "pod-g".into(),
                ip,
                expires_ms: 0,
                kid: String::new(),
            }
            .principal()
        };
        let (a, b) = (mint("m/a", "pod-g"), mint("m/b", "pod-g"));
        let check = |who: &Principal, req: &SessionRequest| {
            check_capabilities(&verifier, who, req, 2_000).map_err(|e| (e.code, e.message))
        };
        let both = shown(
            "pod-g",
            "10.0.0.7",
            &["m/a", "m/b"],
            &[a.as_str(), b.as_str()],
        );
        assert_eq!(check(&bearer("m/a"), &both), Ok(()));
        let forbidden = |r: Result<(), (ErrorCode, String)>, why: &str| {
            let (code, message) = r.unwrap_err();
            assert_eq!(code, ErrorCode::Forbidden, "{message}");
            assert!(message.contains(why), "{why}: {message}");
        };
        // One key's capability does not open a session of another key.
        forbidden(
            check(
                &bearer("m/a"),
                &shown(
                    "pod-g",
                    "10.0.0.7",
                    &["m/a", "m/b"],
                    &[a.as_str(), a.as_str()],
                ),
            ),
            "reads m/a",
        );
        forbidden(
            check(
                &bearer("m/a"),
                &shown("pod-g", "10.0.0.7", &["m/a", "m/b"], &[a.as_str()]),
            ),
            "one per key",
        );
        // Another getter, another IP, a bearer for none of the keys.
        forbidden(
            check(
                &bearer("m/a"),
                &shown("pod-x", "10.0.0.7", &["m/a"], &[a.as_str()]),
            ),
            "minted for agent \"pod-g\"",
        );
        forbidden(
            check(
                &bearer("m/a"),
                &shown("pod-g", "10.0.0.8", &["m/a"], &[a.as_str()]),
            ),
            "bound to 10.0.0.7",
        );
        forbidden(
            check(
                &bearer("m/z"),
                &shown("pod-g", "10.0.0.7", &["m/a"], &[a.as_str()]),
            ),
            "none of the session's keys",
        );
        // Minted for another source; signed by a key this agent lacks.
        let elsewhere = signer.mint(scope("m/a"), "pod-other", "pod-g", 1_000);
        forbidden(
            check(
                &bearer("m/a"),
                &shown("pod-g", "10.0.0.7", &["m/a"], &[&elsewhere]),
            ),
            "source",
        );
        let unknown = Signer::ephemeral(0)
            .unwrap()
            .mint(scope("m/a"), "pod-src", "pod-g", 1_000);
        let (code, _) = check(
            &bearer("m/a"),
            &shown("pod-g", "10.0.0.7", &["m/a"], &[&unknown]),
        )
        .unwrap_err();
        assert_eq!(
            code,
            ErrorCode::Unavailable,
            "a key not learnt yet: tried again"
        );
    }
}
