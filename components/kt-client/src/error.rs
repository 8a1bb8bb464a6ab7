use kt_types::ErrorCode;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error body.
    #[error("{message} ({code}, HTTP {status})")]
    Api {
        status: u16,
        code: ErrorCode,
        message: String,
    },
    #[error("{url}: {source}")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error(transparent)]
    Sync(#[from] kt_sync::SyncError),
    #[error(transparent)]
    Key(#[from] kt_types::KeyError),
    #[error("server sent an invalid manifest: {0}")]
    Manifest(#[from] kt_types::ManifestError),
    /// The pod's node agent is not there or broke its control connection
    /// (`unavailable`: try again once it runs).
    #[error("{0}")]
    Agent(String),
    #[error("{0}")]
    Local(String),
    /// A bounded wait of the call ran out: the metadata server not reached
    /// within the connect timeout, or the call's own timeout
    /// ([`crate::deadline`]). `unavailable`; `phase` says what the call was
    /// doing.
    #[error("{message}")]
    Timeout {
        phase: crate::deadline::Phase,
        message: String,
    },
}

impl From<kt_sync::task::WorkerLost> for ClientError {
    fn from(e: kt_sync::task::WorkerLost) -> Self {
        ClientError::Local(e.to_string())
    }
}

impl From<kt_api::CallError> for ClientError {
    fn from(e: kt_api::CallError) -> Self {
        match e {
            kt_api::CallError::Transport { url, source }
            | kt_api::CallError::Decode { url, source } => ClientError::Http { url, source },
            kt_api::CallError::Status {
                status,
                code,
                message,
                ..
            } => ClientError::Api {
                status,
                code,
                message,
            },
        }
    }
}

impl ClientError {
    /// True when the failure lies with the source a get was fetching from
    /// (unreachable, gone, refusing, corrupt, serving another version), so
    /// another source may succeed; false for local problems (writing the
    /// destination).
    pub fn is_source_failure(&self) -> bool {
        match self {
            ClientError::Http { .. } => true,
            // Whatever the source answered: an agent whose files changed
            // (409), a stale token (401), a lost key (404), an outage (5xx).
            ClientError::Api { .. } => true,
            ClientError::Manifest(_) => true,
            ClientError::Sync(e) => !matches!(
                e,
                kt_sync::SyncError::Io { .. }
                    | kt_sync::SyncError::NotFound { .. }
                    | kt_sync::SyncError::NonUtf8 { .. }
            ),
            ClientError::Key(_)
            | ClientError::Agent(_)
            | ClientError::Local(_)
            | ClientError::Timeout { .. } => false,
        }
    }

    /// The phase a call was in when one of its waits ran out.
    pub fn timed_out_in(&self) -> Option<crate::deadline::Phase> {
        match self {
            ClientError::Timeout { phase, .. } => Some(*phase),
            _ => None,
        }
    }

    /// The server's message, for API errors.
    pub fn message(&self) -> Option<&str> {
        match self {
            ClientError::Api { message, .. } => Some(message),
            _ => None,
        }
    }

    /// The API error code, when the server gave one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Api { code, .. } => Some(*code),
            ClientError::Key(_) => Some(ErrorCode::InvalidKey),
            ClientError::Agent(_) | ClientError::Timeout { .. } => Some(ErrorCode::Unavailable),
            _ => None,
        }
    }
}
