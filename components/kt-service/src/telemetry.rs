//! Logging and signals.

use std::io::IsTerminal;

use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

/// Whether text on stderr may carry colours: only on a terminal, and not
/// when `NO_COLOR` is set to anything (no-color.org). Logs that go to a
/// file, a pipe or CI stay plain text.
pub fn stderr_color() -> bool {
    color_for(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    )
}

fn color_for(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Structured logs on stderr: human-readable on a terminal, JSON otherwise
/// (or as `format` says: "json" or "text"), coloured only where
/// [`stderr_color`] allows. The filter comes from `filter` (e.g. the value
/// of `KT_LOG`), defaulting to `info`.
pub fn init_logging(filter: Option<&str>, format: Option<&str>) {
    let filter =
        EnvFilter::try_new(filter.unwrap_or("info")).unwrap_or_else(|_| EnvFilter::new("info"));
    let json = match format {
        Some("json") => true,
        Some("text") => false,
        _ => !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(stderr_color())
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.try_init()
    };
}

/// Cancels `token` on SIGTERM or SIGINT.
pub fn cancel_on_signals(token: CancellationToken) {
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot install SIGTERM handler");
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        }
        token.cancel();
    });
}

#[cfg(test)]
mod tests {
    use super::color_for;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(color_for(true, None));
        assert!(!color_for(false, None));
        assert!(!color_for(true, Some("1".as_ref())));
        // An empty NO_COLOR does not count (no-color.org).
        assert!(color_for(true, Some("".as_ref())));
    }
}
