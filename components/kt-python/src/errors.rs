//! kt's errors as Python exceptions: the classes of `kt.errors`
//! (`KtError` and its subclasses `NotFound`, `Unauthorized`, `Forbidden`,
//! `Unavailable`, `Timeout`, `InvalidInput`, `Conflict`, `FileExists`),
//! each carrying the server's code and message as `.code` and `.message`.
//! Messages the servers and kt-client word for the CLI (its flags and
//! commands) are put in Python's words here ([`python_words`]).

use kt_client::ClientError;
use kt_types::ErrorCode;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// The class of `kt.errors` an error code raises.
fn class_of(code: Option<ErrorCode>) -> &'static str {
    match code {
        Some(ErrorCode::NotFound) => "NotFound",
        Some(ErrorCode::Unauthorized) => "Unauthorized",
        Some(ErrorCode::Forbidden) => "Forbidden",
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

/// The CLI's words in messages of the servers and kt-client, and what a
/// Python caller writes instead.
const CLI_WORDS: &[(&str, &str)] = &[
    (
        "delete recursively (-r)",
        "delete recursively (recursive=True)",
    ),
    (
        "receive it with get_tensor (kt tensor get)",
        "receive it with kt.get(key, dest=<tensor or state dict>)",
    ),
    (
        "get it with kt tensor get",
        "get it with kt.get(key, dest=<tensors>)",
    ),
    (
        "(`kt get` fetches it)",
        "(kt.get(key, dest=<path>) fetches it)",
    ),
    (
        "--deadline or KT_DEADLINE",
        "kt.configure(deadline=...) or KT_DEADLINE",
    ),
    (
        "--connect-timeout or KT_CONNECT_TIMEOUT",
        kt_types::env::CONNECT_TIMEOUT,
    ),
    (
        "(KT_TOKEN, --token-file)",
        "(token=, token_file=, KT_TOKEN or KT_TOKEN_FILE)",
    ),
];

/// `message` in a Python caller's words.
fn python_words(message: String) -> String {
    CLI_WORDS.iter().fold(message, |m, (cli, py)| {
        if m.contains(cli) {
            m.replace(cli, py)
        } else {
            m
        }
    })
}

/// Whether `e` is, or was caused by, an OS error "File exists" (kt-client
/// words some destination errors as text: then its errno's text).
fn file_exists(e: &(dyn std::error::Error + 'static)) -> bool {
    if e.to_string().contains("(os error 17)") {
        return true;
    }
    let mut at = Some(e);
    while let Some(e) = at {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::AlreadyExists)
        {
            return true;
        }
        at = e.source();
    }
    false
}

/// A `kt.errors` exception of `class` with `code` and `message`.
fn raise(class: &str, code: Option<ErrorCode>, message: String) -> PyErr {
    let message = python_words(message);
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
    let class = match &e {
        // A bounded wait of the call ran out (its `timeout=`, or the
        // metadata server not reached in time).
        ClientError::Timeout { .. } => "Timeout",
        _ if code.is_none() && file_exists(&e) => "FileExists",
        _ => class_of(code),
    };
    raise(class, code, e.to_string())
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

/// The exception of a failed `kt.datasets` call: the API server's answer
/// by its status code, kt's own checks by kind.
#[cfg(feature = "kube")]
pub fn dataset(e: kt_client::datasets::DatasetError) -> PyErr {
    use kt_client::datasets::DatasetError as E;
    let message = e.to_string();
    let (class, code) = match &e {
        E::NotFound(..) => ("NotFound", Some(ErrorCode::NotFound)),
        E::Invalid(_) => ("InvalidInput", Some(ErrorCode::InvalidRequest)),
        E::Timeout { .. } => ("Timeout", Some(ErrorCode::Unavailable)),
        E::Failed { .. } => ("KtError", None),
        E::Connect(_) => ("Unavailable", Some(ErrorCode::Unavailable)),
        E::Api { source, .. } => match source {
            kt_client::datasets::KubeError::Api(s) => match s.code {
                401 => ("Unauthorized", Some(ErrorCode::Unauthorized)),
                403 => ("Forbidden", Some(ErrorCode::Forbidden)),
                404 => ("NotFound", Some(ErrorCode::NotFound)),
                409 => ("Conflict", Some(ErrorCode::Conflict)),
                400 | 422 => ("InvalidInput", Some(ErrorCode::InvalidRequest)),
                _ => ("Unavailable", Some(ErrorCode::Unavailable)),
            },
            _ => ("Unavailable", Some(ErrorCode::Unavailable)),
        },
    };
    raise(class, code, message)
}

/// `kt.errors.Unavailable` (code `unavailable`).
#[cfg(feature = "kube")]
pub fn unavailable(message: impl Into<String>) -> PyErr {
    raise("Unavailable", Some(ErrorCode::Unavailable), message.into())
}
