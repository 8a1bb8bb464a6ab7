//! kt's errors as Python exceptions: the classes of `kt.errors`
//! (`KtError` and its subclasses `NotFound`, `Unauthorized`,
//! `Unavailable`, `InvalidInput`, `Conflict`), each carrying the server's
//! code and message as `.code` and `.message`.

use kt_client::ClientError;
use kt_types::ErrorCode;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// The class of `kt.errors` an error code raises.
fn class_of(code: Option<ErrorCode>) -> &'static str {
    match code {
        Some(ErrorCode::NotFound) => "NotFound",
        // `.code` says which: a bad token, or a role that may not.
        Some(ErrorCode::Unauthorized | ErrorCode::Forbidden) => "Unauthorized",
        Some(
            ErrorCode::NoStore
            | ErrorCode::NoSource
            | ErrorCode::Unavailable
            | ErrorCode::InsufficientStorage,
        ) => "Unavailable",
        Some(
            ErrorCode::InvalidKey
            | ErrorCode::InvalidManifest
            | ErrorCode::InvalidRequest
            | ErrorCode::PayloadTooLarge,
        ) => "InvalidInput",
        Some(ErrorCode::Conflict) => "Conflict",
        _ => "KtError",
    }
}

/// A `kt.errors` exception of `class` with `code` and `message`.
fn raise(class: &str, code: Option<ErrorCode>, message: String) -> PyErr {
    Python::attach(|py| {
        let made = py
            .import("kt.errors")
            .and_then(|m| m.getattr(class))
            .and_then(|cls| cls.call1((message.clone(), code.map(|c| c.as_str()))));
        match made {
            Ok(exc) => PyErr::from_value(exc),
            // The package's Python half is missing (the module imported
            // alone): still an error, with the message.
            Err(_) => PyRuntimeError::new_err(message),
        }
    })
}

/// An error of kt as the exception a Python caller catches.
pub fn to_py(e: ClientError) -> PyErr {
    let code = e.code();
    let code = match (&e, code) {
        // A server that was not reached is away, not a bug.
        (ClientError::Http { .. }, None) => Some(ErrorCode::Unavailable),
        (ClientError::Sync(kt_sync_error), None) if is_local_input(kt_sync_error) => {
            Some(ErrorCode::InvalidRequest)
        }
        _ => code,
    };
    raise(class_of(code), code, e.to_string())
}

/// Sync errors that are the caller's input: a source that is not there.
fn is_local_input(e: &kt_sync::SyncError) -> bool {
    matches!(
        e,
        kt_sync::SyncError::NotFound { .. } | kt_sync::SyncError::NonUtf8 { .. }
    )
}

/// `kt.errors.InvalidInput` (code `invalid_request`).
pub fn invalid(message: impl Into<String>) -> PyErr {
    raise(
        "InvalidInput",
        Some(ErrorCode::InvalidRequest),
        message.into(),
    )
}

/// `kt.errors.Unauthorized` (code `unauthorized`).
pub fn unauthorized(message: impl Into<String>) -> PyErr {
    raise(
        "Unauthorized",
        Some(ErrorCode::Unauthorized),
        message.into(),
    )
}
