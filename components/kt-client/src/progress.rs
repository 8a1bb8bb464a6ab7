//! Progress reporting, decoupled from any terminal library.

use std::sync::Arc;

/// Receives transfer progress. Implementations must be cheap: `advance` is
/// called once per file or chunk.
pub trait ProgressSink: Send + Sync {
    /// The transfer will move `bytes` in `files` files.
    fn start(&self, bytes: u64, files: u64);
    fn advance(&self, bytes: u64);
    fn finish(&self);
}

/// A shareable progress sink (or none).
#[derive(Clone, Default)]
pub struct Progress(Option<Arc<dyn ProgressSink>>);

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Progress(on)"
        } else {
            "Progress(off)"
        })
    }
}

impl Progress {
    pub fn none() -> Self {
        Progress(None)
    }
    pub fn new(sink: Arc<dyn ProgressSink>) -> Self {
        Progress(Some(sink))
    }
    pub fn start(&self, bytes: u64, files: u64) {
        if let Some(s) = &self.0 {
            s.start(bytes, files);
        }
    }
    pub fn advance(&self, bytes: u64) {
        if let Some(s) = &self.0 {
            s.advance(bytes);
        }
    }
    pub fn finish(&self) {
        if let Some(s) = &self.0 {
            s.finish();
        }
    }
    /// As a callback for the sync engine.
    pub fn callback(&self) -> Option<kt_sync::batch::Progress> {
        self.0.clone().map(|s| {
            let f: kt_sync::batch::Progress = Arc::new(move |n| s.advance(n));
            f
        })
    }
}
