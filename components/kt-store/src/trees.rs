//! Listing and deleting trees (`/api/v1/trees`).

use axum::extract::{Path, Query, State};
use kt_service::{ApiError, ApiJson};
use kt_types::Key;
use kt_types::api::{DeleteResponse, TreeDeleteQuery, TreeList};

use crate::state::AppState;
use crate::versions::published;

/// `DELETE /api/v1/trees/{key}`: removes a key and all its versions.
pub async fn delete_tree(
    State(s): State<AppState>,
    Path(key): Path<String>,
    Query(q): Query<TreeDeleteQuery>,
) -> Result<ApiJson<DeleteResponse>, ApiError> {
    let key = Key::parse(&key)?;
    let (mut st, cur) = published(&s.keys, &key).await?;
    if let Some(v) = q.version.filter(|v| *v != cur.version) {
        return Err(ApiError::new(
            kt_types::ErrorCode::Conflict,
            format!("{key} is at version {}, not {v}", cur.version),
        ));
    }
    if q.orphaned {
        // Asked under the key's lock: a commit or an unchanged put
        // registers under it too, so the answer holds until the removal.
        match s.registrar.record(&key).await {
            Ok(rec) if rec.holder == kt_types::STORE_HOLDER && rec.version == cur.version => {
                return Err(ApiError::new(
                    kt_types::ErrorCode::Conflict,
                    format!(
                        "{key} at version {} is the store's again: kept",
                        cur.version
                    ),
                ));
            }
            Ok(_) => {}
            Err(e) if e.code() == kt_types::ErrorCode::NotFound => {}
            Err(e) => {
                return Err(ApiError::new(
                    kt_types::ErrorCode::Unavailable,
                    format!(
                        "could not ask the metadata server whether {key} is still the store's: {e}"
                    ),
                ));
            }
        }
    }
    s.remove_key(&key, &mut st).await?;
    tracing::info!(%key, orphaned = q.orphaned, "tree deleted");
    Ok(ApiJson(DeleteResponse { deleted: vec![key] }))
}

/// `GET /api/v1/trees`: every key the store holds.
pub async fn list(State(s): State<AppState>) -> ApiJson<TreeList> {
    let mut keys = Vec::new();
    for (k, st) in s.keys.all() {
        if st.lock().await.current.is_some() {
            keys.push(k);
        }
    }
    keys.sort();
    ApiJson(TreeList { keys })
}
