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

impl ApiError {
    /// A failed call of this server to `upstream` (the metadata server, a
    /// peer agent), as this server answers its own caller: the one mapping
    /// every server uses.
    ///
    /// - not reached (refused, reset, timed out), or an answer that does
    ///   not decode (an upstream restarting mid-answer): `unreachable`,
    ///   which the caller says — `unavailable` where the same server is
    ///   needed again (retry), `no_source` where another source may serve
    ///   instead;
    /// - `unauthorized`/`forbidden`: the upstream refused *this server's*
    ///   own credentials (a rotated token, a changed role), not the
    ///   caller's, so the caller gets `unreachable` too, with a message
    ///   saying whose credentials failed;
    /// - any other error answer: its code (a 404 is an absence, a 500 a
    ///   failure, not an outage to wait out), the message naming
    ///   `upstream`.
    pub fn from_call(e: kt_api::CallError, upstream: &str, unreachable: ErrorCode) -> ApiError {
        match e {
            kt_api::CallError::Transport { url, source } => ApiError::new(
                unreachable,
                format!("{upstream} unreachable ({url}): {source}"),
            ),
            kt_api::CallError::Status { code, message, .. }
                if matches!(code, ErrorCode::Unauthorized | ErrorCode::Forbidden) =>
            {
                tracing::warn!(%upstream, %code, %message, "upstream refused this server's own credentials");
                ApiError::new(
                    unreachable,
                    format!("{upstream} refused this server's own credentials ({code}): {message}"),
                )
            }
            kt_api::CallError::Status { code, message, .. } => {
                ApiError::new(code, format!("{upstream}: {message}"))
            }
            kt_api::CallError::Decode { url, source } => {
                tracing::warn!(%upstream, %url, error = %source, "unreadable answer from upstream");
                ApiError::new(
                    unreachable,
                    format!("unreadable answer from {upstream} ({url}): {source}"),
                )
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.code == ErrorCode::Internal {
            tracing::error!(message = %self.message, "internal error");
        }
        let status = self.status();
        let body = ErrorBody::new(self.code, self.message).with_trace(crate::trace::current_id());
        (status, axum::Json(body)).into_response()
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

impl<T: DeserializeOwned> ApiJson<T> {
    /// A body already read (e.g. with [`ApiBytes`], against a budget),
    /// decoded with the extractor's error codes (`invalid_key` for a bad
    /// key, else `invalid_request`).
    pub fn from_bytes(body: &[u8]) -> Result<Self, ApiError> {
        axum::Json::<T>::from_bytes(body)
            .map(|axum::Json(v)| ApiJson(v))
            .map_err(from_rejection)
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

/// A whole request body, with rejections (too large, cut) mapped to
/// [`ApiError`], and its share of the server's [`BodyBudget`] (when the
/// route has one), held as long as the bytes are.
#[derive(Debug, Default)]
pub struct ApiBytes(pub axum::body::Bytes, pub Option<BodyPermit>);

/// How many bytes of request bodies a server holds in memory at once
/// ([`ApiBytes`]), whatever the number of requests: a route layer
/// (`.layer(Extension(BodyBudget::new(n)))`). A body is admitted when its
/// `Content-Length` fits (waiting up to [`BodyBudget::WAIT`] for others to
/// finish, then `unavailable`); one larger than the whole budget, or
/// without a length, is `payload_too_large` at once.
#[derive(Debug, Clone)]
pub struct BodyBudget {
    kib: std::sync::Arc<tokio::sync::Semaphore>,
    bytes: u64,
}

/// A body's share of a [`BodyBudget`], given back when dropped.
#[derive(Debug)]
pub struct BodyPermit(#[allow(dead_code)] tokio::sync::OwnedSemaphorePermit);

impl BodyBudget {
    /// How long a body waits for the budget before `unavailable`.
    pub const WAIT: std::time::Duration = std::time::Duration::from_secs(30);

    pub fn new(bytes: u64) -> BodyBudget {
        let kib = usize::try_from(bytes.div_ceil(1024))
            .unwrap_or(usize::MAX)
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        BodyBudget {
            kib: std::sync::Arc::new(tokio::sync::Semaphore::new(kib)),
            bytes,
        }
    }

    async fn admit(&self, len: Option<u64>) -> Result<BodyPermit, ApiError> {
        let too_large = |what: String| ApiError::new(ErrorCode::PayloadTooLarge, what);
        let len = len.ok_or_else(|| {
            too_large("a request body of this kind needs a Content-Length".into())
        })?;
        if len > self.bytes {
            return Err(too_large(format!(
                "a request body of {len} bytes: this server holds at most {} bytes of bodies in memory",
                self.bytes
            )));
        }
        let kib = u32::try_from(len.div_ceil(1024)).unwrap_or(u32::MAX);
        match tokio::time::timeout(Self::WAIT, self.kib.clone().acquire_many_owned(kib)).await {
            Ok(Ok(p)) => Ok(BodyPermit(p)),
            _ => Err(ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "busy: other request bodies fill this server's {} bytes for them; try again",
                    self.bytes
                ),
            )),
        }
    }
}

/// The body of `req`, `len` bytes (its admitted `Content-Length`), read
/// into one buffer of that size: the bytes are held once, not as frames
/// and again as their concatenation.
async fn read_exactly(req: Request, len: usize) -> Result<axum::body::Bytes, ApiError> {
    use futures::StreamExt;
    let mut buf = bytes::BytesMut::with_capacity(len);
    let mut frames = req.into_body().into_data_stream();
    while let Some(frame) = frames.next().await {
        let frame = frame.map_err(|e| ApiError::new(ErrorCode::Truncated, e.to_string()))?;
        if buf.len() + frame.len() > len {
            return Err(ApiError::new(
                ErrorCode::PayloadTooLarge,
                format!("the body is longer than its Content-Length ({len})"),
            ));
        }
        buf.extend_from_slice(&frame);
    }
    if buf.len() < len {
        return Err(ApiError::new(
            ErrorCode::Truncated,
            format!("the body ended after {} of {len} bytes", buf.len()),
        ));
    }
    Ok(buf.freeze())
}

impl<S: Send + Sync> FromRequest<S> for ApiBytes {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        if let Some(budget) = req.extensions().get::<BodyBudget>().cloned() {
            let len = req
                .headers()
                .get(axum::http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            let permit = budget.admit(len).await?;
            let len = len.unwrap_or_default() as usize;
            return Ok(ApiBytes(read_exactly(req, len).await?, Some(permit)));
        }
        match axum::body::Bytes::from_request(req, state).await {
            Ok(b) => Ok(ApiBytes(b, None)),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What a failed upstream call becomes: the caller's "unreachable",
    /// the upstream's own code, or internal.
    #[tokio::test]
    async fn a_failed_call_maps_to_one_api_error() {
        let status = |code: ErrorCode| kt_api::CallError::Status {
            url: "http://m/api/v1/keys/a".into(),
            status: code.http_status(),
            code,
            message: "no".into(),
        };
        for code in [
            ErrorCode::Internal,
            ErrorCode::NotFound,
            ErrorCode::Conflict,
        ] {
            let e = ApiError::from_call(status(code), "metadata server", ErrorCode::NoSource);
            assert_eq!(e, ApiError::new(code, "metadata server: no"));
        }
        // The upstream refusing this server's own token is not the
        // caller's refusal: the caller's "unreachable" (retryable), with a
        // message saying whose credentials failed.
        for code in [ErrorCode::Unauthorized, ErrorCode::Forbidden] {
            for unreachable in [ErrorCode::Unavailable, ErrorCode::NoSource] {
                let e = ApiError::from_call(status(code), "metadata server", unreachable);
                assert_eq!(e.code, unreachable, "{code}");
                assert!(
                    e.message.contains("this server's own credentials"),
                    "{}",
                    e.message
                );
            }
        }
        // An answer that does not decode (an upstream restarting
        // mid-answer): the caller's "unreachable", not `internal`.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().route("/x", axum::routing::get(|| async { "not json" }));
        tokio::spawn(async move { axum::serve(listener, app).await });
        let api = kt_api::Api::new(kt_api::client(), &format!("http://{addr}"), "t");
        let e = api
            .get("/x")
            .fetch::<serde_json::Value>()
            .await
            .unwrap_err();
        assert!(matches!(e, kt_api::CallError::Decode { .. }), "{e:?}");
        let e = ApiError::from_call(e, "metadata server", ErrorCode::Unavailable);
        assert_eq!(e.code, ErrorCode::Unavailable, "{}", e.message);
        // Nobody listens on a port bound and dropped: not reached.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let api = kt_api::Api::new(kt_api::client(), &format!("http://127.0.0.1:{port}"), "t");
        for unreachable in [ErrorCode::Unavailable, ErrorCode::NoSource] {
            let e = api.get("/x").ok().await.unwrap_err();
            assert!(matches!(e, kt_api::CallError::Transport { .. }), "{e:?}");
            let e = ApiError::from_call(e, "the holder", unreachable);
            assert_eq!(e.code, unreachable);
            assert!(
                e.message.starts_with("the holder unreachable"),
                "{}",
                e.message
            );
        }
    }
}
