//! The store's registration: `POST /api/v1/stores` and `GET /api/v1/store`.

use axum::extract::State;
use axum::http::StatusCode;
use kt_service::{ApiError, ApiJson};
use kt_types::ErrorCode;
use kt_types::api::{RegisterStore, StoreLocation};

use super::{AppState, db_err};

pub(super) async fn register_store(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<RegisterStore>,
) -> Result<StatusCode, ApiError> {
    if !(req.url.starts_with("http://") || req.url.starts_with("https://")) {
        return Err(ApiError::bad_request(format!(
            "store url {:?} is not an http(s) URL",
            req.url
        )));
    }
    s.db.set_store_url(&req.url).map_err(db_err)?;
    *s.store_url.lock().await = Some(req.url.clone());
    tracing::info!(url = %req.url, "store registered");
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn get_store(
    State(s): State<AppState>,
) -> Result<ApiJson<StoreLocation>, ApiError> {
    match s.store_url.lock().await.clone() {
        Some(url) => Ok(ApiJson(StoreLocation { url })),
        None => Err(ApiError::new(
            ErrorCode::NoStore,
            "no store server has registered with this metadata server",
        )),
    }
}
