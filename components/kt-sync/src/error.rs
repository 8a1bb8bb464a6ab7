use std::path::PathBuf;

use kt_types::ManifestError;

/// Everything that can go wrong while scanning, sending or receiving a tree.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: file name is not valid UTF-8; rename it to transfer it", path.display())]
    NonUtf8 { path: PathBuf },
    #[error(
        "symlink {path:?} -> {target:?} points outside the tree; it would not resolve on the receiver"
    )]
    LinkEscapes { path: String, target: String },
    #[error("{}: not found", path.display())]
    NotFound { path: PathBuf },
    #[error("{path:?}: content does not match its hash (corrupt or changed during the transfer)")]
    HashMismatch { path: String },
    #[error(
        "{path:?}: expected {expected} bytes, got {actual} (the file changed during the transfer?)"
    )]
    SizeMismatch {
        path: String,
        expected: u64,
        actual: u64,
    },
    #[error("stream ended before its end record (truncated)")]
    Truncated,
    #[error("stream carries entry #{index}, which was not requested or came twice")]
    UnexpectedEntry { index: u32 },
    #[error("stream continues after its end record")]
    TrailingData,
    #[error("chunk {chunk} of {path:?} is out of range")]
    BadChunk { path: String, chunk: u64 },
    #[error("invalid manifest: {0}")]
    Manifest(#[from] ManifestError),
    #[error("stream failed: {0}")]
    Stream(String),
    #[error("chunk size {0} is not a power of two of at least 1024")]
    BadChunkSize(u64),
}

impl SyncError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            SyncError::NotFound { path }
        } else {
            SyncError::Io { path, source }
        }
    }
}

/// Attaches a path to an I/O result.
pub(crate) trait IoContext<T> {
    fn at(self, path: &std::path::Path) -> Result<T, SyncError>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: &std::path::Path) -> Result<T, SyncError> {
        self.map_err(|e| SyncError::io(path, e))
    }
}
