//! The quorum routes: HTTP around [`Quorums`], and the one place a
//! [`QuorumError`] becomes an [`ApiError`].

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{DefaultBodyLimit, Extension, FromRequest, Path, Query, Request, State};
use axum::routing::{get, post};
use kt_service::{ApiBytes, ApiError, ApiJson};
use kt_types::auth::Principal;
use kt_types::tensor::{
    QuorumDone, QuorumInfo, QuorumJoin, QuorumPlan, QuorumRole, QuorumStatus, Rendezvous,
};
use serde::Deserialize;

use super::coordinator::Quorums;
use super::round::{Access, QuorumError};

/// Default and longest long poll of the rendezvous and status routes.
pub const DEFAULT_WAIT_MS: u64 = 30_000;
pub const MAX_WAIT_MS: u64 = 600_000;
/// Largest join body (a state dict's layout: names, dtypes, shapes; a
/// model of 100 000 tensors takes about 10 MiB). The metadata server's body
/// budget holds two of them.
pub const MAX_JOIN_BODY: usize = 16 << 20;

impl From<QuorumError> for ApiError {
    fn from(e: QuorumError) -> Self {
        ApiError::new(e.code(), e.to_string())
    }
}

/// `?wait_ms=N` of the long-polled routes.
#[derive(Debug, Deserialize)]
struct Wait {
    #[serde(default)]
    wait_ms: Option<u64>,
}

fn wait(q: Result<Query<Wait>, QueryRejection>, default_ms: u64) -> Result<Duration, ApiError> {
    let Query(w) = q.map_err(|r| ApiError::bad_request(r.body_text()))?;
    Ok(Duration::from_millis(
        w.wait_ms.unwrap_or(default_ms).min(MAX_WAIT_MS),
    ))
}

/// Which service owns a key (the metadata server's registry).
pub type Owners = Arc<dyn kt_service::reads::Owners>;

/// The quorum routes (merged into the metadata server's API, behind its
/// auth); `owners` says whose keys a getter asks for.
pub fn routes(q: Arc<Quorums>, owners: Owners) -> Router {
    // Agents take part; operators look.
    use kt_service::{ADMIN, allow};
    use kt_types::auth::Role::Agent;
    Router::new()
        .route("/api/v1/quorums/{group}", allow(ADMIN, get(info)))
        .route(
            "/api/v1/quorums/{group}/join",
            allow(
                &[Agent],
                post(join).layer(DefaultBodyLimit::max(MAX_JOIN_BODY)),
            ),
        )
        .route(
            "/api/v1/quorums/{group}/{transfer}",
            allow(ADMIN, get(transfer_status)),
        )
        .route(
            "/api/v1/quorums/{group}/{transfer}/rendezvous",
            allow(&[Agent], get(get_rendezvous).put(put_rendezvous)),
        )
        .route(
            "/api/v1/quorums/{group}/{transfer}/done",
            allow(&[Agent], post(done)),
        )
        .layer(Extension(owners))
        .with_state(q)
}

async fn info(
    State(q): State<Arc<Quorums>>,
    Path(group): Path<String>,
) -> Result<ApiJson<QuorumInfo>, ApiError> {
    Ok(ApiJson(q.info(&group)?))
}

/// A join's body, decoded, and its size; at most [`MAX_JOIN_BODY`], read
/// against the server's body budget (when it has one), which is given
/// back once it is decoded: from then on the coordinator's
/// [`JoinLimits`](super::JoinLimits) count it.
async fn join_body(req: Request) -> Result<(QuorumJoin, usize), ApiError> {
    let too_large = |len: u64| {
        ApiError::new(
            kt_types::ErrorCode::PayloadTooLarge,
            format!("a quorum join of {len} bytes: the most is {MAX_JOIN_BODY}"),
        )
    };
    // Refused before a byte is read: a budget admits bodies up to its
    // whole size.
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared.filter(|n| *n > MAX_JOIN_BODY as u64) {
        return Err(too_large(len));
    }
    let ApiBytes(body, _budget) = ApiBytes::from_request(req, &()).await?;
    if body.len() > MAX_JOIN_BODY {
        return Err(too_large(body.len() as u64));
    }
    let ApiJson(j) = ApiJson::<QuorumJoin>::from_bytes(&body)?;
    Ok((j, body.len()))
}

async fn join(
    State(q): State<Arc<Quorums>>,
    Extension(who): Extension<Principal>,
    Extension(owners): Extension<Owners>,
    Path(group): Path<String>,
    req: Request,
) -> Result<ApiJson<QuorumPlan>, ApiError> {
    let (j, bytes) = join_body(req).await?;
    // An agent joins as itself (and so takes only its own rank).
    if !who.is_agent(&j.agent) {
        return Err(kt_service::forbidden(format!(
            "this agent token is {:?}'s; it may not join as {:?}",
            who.name.as_deref().unwrap_or_default(),
            j.agent
        )));
    }
    if who.ip.is_some() && j.ip.parse().ok() != who.ip {
        return Err(kt_service::forbidden(format!(
            "this pod's token may join from its own IP only, not {:?}",
            j.ip
        )));
    }
    // A getter receives only the keys of services its token reads: those
    // registered now are refused at once; the round checks the rest
    // against the owners of its putters' keys (putters register their keys
    // before they join) before it makes its plan.
    let access = match &j.role {
        QuorumRole::Get { keys } => {
            for k in keys {
                match kt_service::reads::check_owner(owners.as_ref(), &who, &k.key).await {
                    Err(e) if e.code == kt_types::ErrorCode::NotFound => {}
                    r => r?,
                }
            }
            Access {
                reader: (!who.reads_all()).then(|| who.clone()),
                bytes,
                ..Access::default()
            }
        }
        QuorumRole::Put { keys } => {
            let mut owned = std::collections::HashMap::new();
            for k in keys {
                let service = match owners.service_of(&k.key).await {
                    Ok(s) => Some(s),
                    Err(e) if e.code == kt_types::ErrorCode::NotFound => None,
                    Err(e) => return Err(e),
                };
                // A putter sends the key's data to every getter: it must
                // write the key's service (a registered key's, else the
                // first segment's), or it could stand in for the key's
                // real holder and lock it out.
                let owner = service.as_deref().unwrap_or_else(|| k.key.service());
                if !who.serves(owner) {
                    return Err(kt_service::forbidden(format!(
                        "this token may not put {} into a quorum: it belongs to service {owner:?}, not one of this token's",
                        k.key
                    )));
                }
                owned.insert(k.key.clone(), service);
            }
            Access {
                owners: owned,
                bytes,
                ..Access::default()
            }
        }
    };
    Ok(ApiJson(q.join(&group, j, access).await?))
}

/// The caller, which must be the agent of one of `ranks` of transfer
/// `id` (all of them: `None`).
fn member_of(
    q: &Quorums,
    who: &Principal,
    group: &str,
    id: &str,
    rank: Option<u32>,
) -> Result<(), ApiError> {
    let agents = q.agents(group, id)?;
    let ok = match rank {
        Some(r) => agents.get(r as usize).is_none_or(|a| who.is_agent(a)),
        None => agents.iter().any(|a| who.is_agent(a)),
    };
    if ok {
        return Ok(());
    }
    let what = match rank {
        Some(r) => format!("rank {r} of"),
        None => "a member of".to_owned(),
    };
    Err(kt_service::forbidden(format!(
        "this token's agent {:?} is not {what} transfer {id} of quorum {group}",
        who.name.as_deref().unwrap_or_default()
    )))
}

async fn put_rendezvous(
    State(q): State<Arc<Quorums>>,
    Extension(who): Extension<Principal>,
    Path((group, id)): Path<(String, String)>,
    ApiJson(r): ApiJson<Rendezvous>,
) -> Result<ApiJson<Rendezvous>, ApiError> {
    // Rank 0 bootstraps the communicator.
    member_of(&q, &who, &group, &id, Some(0))?;
    q.publish(&group, &id, r.clone())?;
    Ok(ApiJson(r))
}

async fn get_rendezvous(
    State(q): State<Arc<Quorums>>,
    Extension(who): Extension<Principal>,
    Path((group, id)): Path<(String, String)>,
    w: Result<Query<Wait>, QueryRejection>,
) -> Result<ApiJson<Rendezvous>, ApiError> {
    let wait = wait(w, DEFAULT_WAIT_MS)?;
    member_of(&q, &who, &group, &id, None)?;
    Ok(ApiJson(q.rendezvous(&group, &id, wait).await?))
}

async fn done(
    State(q): State<Arc<Quorums>>,
    Extension(who): Extension<Principal>,
    Path((group, id)): Path<(String, String)>,
    ApiJson(d): ApiJson<QuorumDone>,
) -> Result<ApiJson<QuorumStatus>, ApiError> {
    // A rank reports for itself (a rank out of range is the coordinator's
    // `invalid_request`).
    member_of(&q, &who, &group, &id, Some(d.rank))?;
    Ok(ApiJson(q.done(&group, &id, d)?))
}

async fn transfer_status(
    State(q): State<Arc<Quorums>>,
    Path((group, id)): Path<(String, String)>,
    w: Result<Query<Wait>, QueryRejection>,
) -> Result<ApiJson<QuorumStatus>, ApiError> {
    let wait = wait(w, 0)?;
    Ok(ApiJson(q.status(&group, &id, wait).await?))
}
