//! Error codes and the JSON error body every API returns:
//! `{"error":{"code":"...","message":"..."}}`.

use serde::{Deserialize, Serialize};

/// Machine-readable error codes. Each maps to one HTTP status at the server boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    Unauthorized,
    InvalidKey,
    InvalidManifest,
    InvalidRequest,
    NotFound,
    Conflict,
    PayloadTooLarge,
    HashMismatch,
    Truncated,
    NoStore,
    /// A key exists but none of its sources is alive.
    NoSource,
    Unavailable,
    Internal,
}

impl ErrorCode {
    /// The HTTP status this code is answered with.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::Unauthorized => 401,
            ErrorCode::InvalidKey
            | ErrorCode::InvalidManifest
            | ErrorCode::InvalidRequest
            | ErrorCode::HashMismatch
            | ErrorCode::Truncated => 400,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::NoStore | ErrorCode::NoSource | ErrorCode::Unavailable => 503,
            ErrorCode::Internal => 500,
        }
    }

    /// The code an answer with this HTTP status and no error body of ours
    /// stands for (a proxy's, or a server that is not kt).
    pub fn from_status(status: u16) -> ErrorCode {
        match status {
            401 | 403 => ErrorCode::Unauthorized,
            400 => ErrorCode::InvalidRequest,
            404 => ErrorCode::NotFound,
            409 => ErrorCode::Conflict,
            413 => ErrorCode::PayloadTooLarge,
            502..=504 => ErrorCode::Unavailable,
            _ => ErrorCode::Internal,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::InvalidKey => "invalid_key",
            ErrorCode::InvalidManifest => "invalid_manifest",
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::HashMismatch => "hash_mismatch",
            ErrorCode::Truncated => "truncated",
            ErrorCode::NoStore => "no_store",
            ErrorCode::NoSource => "no_source",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Internal => "internal",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub code: ErrorCode,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

impl ErrorBody {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                code,
                message: message.into(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_shape() {
        let b = ErrorBody::new(ErrorCode::InvalidKey, "bad");
        assert_eq!(
            serde_json::to_string(&b).unwrap(),
            r#"{"error":{"code":"invalid_key","message":"bad"}}"#
        );
        assert_eq!(
            serde_json::to_value(ErrorCode::PayloadTooLarge).unwrap(),
            ErrorCode::PayloadTooLarge.as_str()
        );
    }
}
