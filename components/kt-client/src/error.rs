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
    #[error("{0}")]
    Local(String),
}

impl ClientError {
    /// The API error code, when the server gave one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Api { code, .. } => Some(*code),
            ClientError::Key(_) => Some(ErrorCode::InvalidKey),
            _ => None,
        }
    }
}
