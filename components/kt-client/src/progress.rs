//! Progress reporting: a sink trait the transfer code reports to, and the
//! terminal bar the CLI and the Python package plug in.

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

/// A progress bar on stderr (indicatif).
struct Bar(indicatif::ProgressBar);

impl ProgressSink for Bar {
    fn start(&self, bytes: u64, files: u64) {
        self.0.set_length(bytes);
        self.0.set_message(format!("{files} files"));
    }
    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

impl Progress {
    /// A bar on stderr when `on` (bytes, files, rate, ETA), else none.
    pub fn terminal_bar(on: bool) -> Self {
        if !on {
            return Progress::none();
        }
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {bytes}/{total_bytes} {msg} {bytes_per_sec} ETA {eta} [{wide_bar}]",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Progress::new(Arc::new(Bar(bar)))
    }
}
