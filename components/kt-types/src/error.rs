//! Error codes and the JSON error body every API returns:
//! `{"error":{"code":"...","message":"..."}}`.

use serde::{Deserialize, Serialize};

/// Machine-readable error codes. Each maps to one HTTP status at the server boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The bearer token is missing or wrong (401).
    Unauthorized,
    /// The token is good, but its role (or the agent or services it is
    /// given) may not do this (403; see [`crate::auth`]).
    Forbidden,
    /// A key or key prefix breaks the key grammar ([`crate::key`]) (400).
    InvalidKey,
    /// A manifest does not decode, or fails validation
    /// ([`crate::Manifest::validate`]) (400).
    InvalidManifest,
    /// Any other malformed or refused input: a body, query, id, option or
    /// a request the protocol does not allow at this point (400).
    InvalidRequest,
    /// What the request names (key, lease, upload session, broadcast
    /// group, quorum transfer, ...) does not exist, or no longer does (404).
    NotFound,
    /// The request contradicts the current state: the key moved on to
    /// another version, a broadcast group closed, an upload is incomplete,
    /// another process holds the registration, ... (409).
    Conflict,
    /// A body or message is larger than its limit (413).
    PayloadTooLarge,
    /// The store has no room for what the request would write (507): a
    /// final answer, not retried; the message says how much is needed and
    /// how much is free.
    InsufficientStorage,
    /// Received content does not hash to what its manifest says (400).
    HashMismatch,
    /// A body ended before it was complete (400).
    Truncated,
    /// No store server has registered with the metadata server (503).
    NoStore,
    /// A key exists but none of its sources is alive.
    NoSource,
    /// A server or peer the request needs cannot be reached or cannot
    /// serve it now; trying again later may succeed (503).
    Unavailable,
    /// A failure inside the server that the request did not cause (500).
    Internal,
}

impl ErrorCode {
    /// The HTTP status this code is answered with.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::InvalidKey
            | ErrorCode::InvalidManifest
            | ErrorCode::InvalidRequest
            | ErrorCode::HashMismatch
            | ErrorCode::Truncated => 400,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::InsufficientStorage => 507,
            ErrorCode::NoStore | ErrorCode::NoSource | ErrorCode::Unavailable => 503,
            ErrorCode::Internal => 500,
        }
    }

    /// The code an answer with this HTTP status and no error body of ours
    /// stands for (a proxy's, or a server that is not kt).
    pub fn from_status(status: u16) -> ErrorCode {
        match status {
            401 => ErrorCode::Unauthorized,
            403 => ErrorCode::Forbidden,
            400 => ErrorCode::InvalidRequest,
            404 => ErrorCode::NotFound,
            409 => ErrorCode::Conflict,
            413 => ErrorCode::PayloadTooLarge,
            507 => ErrorCode::InsufficientStorage,
            502..=504 => ErrorCode::Unavailable,
            _ => ErrorCode::Internal,
        }
    }

    /// The name on the wire (snake_case), as in `{"code":"not_found"}`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::InvalidKey => "invalid_key",
            ErrorCode::InvalidManifest => "invalid_manifest",
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::InsufficientStorage => "insufficient_storage",
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

/// The `error` object of an [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// What kind of failure, for programs to act on.
    pub code: ErrorCode,
    /// What went wrong, for people: names the offending value.
    pub message: String,
    /// The trace of the request that failed (32 hex digits), for people
    /// to quote: the same id is on the server's log lines for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

/// The body of every error answer of the HTTP APIs, sent with the status
/// of its code ([`ErrorCode::http_status`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The code and the message.
    pub error: ErrorDetail,
}

impl ErrorBody {
    /// A body with this code and message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                code,
                message: message.into(),
                trace_id: None,
            },
        }
    }

    /// The same, naming the request's trace.
    pub fn with_trace(mut self, trace_id: Option<String>) -> Self {
        self.error.trace_id = trace_id;
        self
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
