use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kt_types::{ErrorBody, ErrorCode};
use serde::de::DeserializeOwned;

/// An error answered to a client: a code, which fixes the status, and a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl From<kt_sync::task::WorkerLost> for ApiError {
    fn from(e: kt_sync::task::WorkerLost) -> Self {
        ApiError::internal(e.to_string())
    }
}

impl From<kt_types::KeyError> for ApiError {
    fn from(e: kt_types::KeyError) -> Self {
        ApiError::new(ErrorCode::InvalidKey, e.to_string())
    }
}

impl From<kt_types::ManifestError> for ApiError {
    fn from(e: kt_types::ManifestError) -> Self {
        ApiError::new(ErrorCode::InvalidManifest, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.code == ErrorCode::Internal {
            tracing::error!(message = %self.message, "internal error");
        }
        let status = self.status();
        (status, axum::Json(ErrorBody::new(self.code, self.message))).into_response()
    }
}

/// `axum::Json` with rejections mapped to [`ApiError`] (so bad bodies get the JSON error shape).
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(ApiJson(v)),
            Err(rejection) => Err(from_rejection(rejection)),
        }
    }
}

fn from_rejection(r: JsonRejection) -> ApiError {
    let status = r.status();
    let text = r.body_text();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(ErrorCode::PayloadTooLarge, text)
    } else if text.contains("key") && text.contains("segment") {
        ApiError::new(ErrorCode::InvalidKey, text)
    } else {
        ApiError::bad_request(text)
    }
}

/// A whole request body, with rejections (too large, cut) mapped to [`ApiError`].
#[derive(Debug, Clone, Default)]
pub struct ApiBytes(pub axum::body::Bytes);

impl<S: Send + Sync> FromRequest<S> for ApiBytes {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::body::Bytes::from_request(req, state).await {
            Ok(b) => Ok(ApiBytes(b)),
            Err(r) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ApiError::new(ErrorCode::PayloadTooLarge, r.body_text()))
            }
            Err(r) => Err(ApiError::new(ErrorCode::Truncated, r.body_text())),
        }
    }
}

impl<T: serde::Serialize> IntoResponse for ApiJson<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}
