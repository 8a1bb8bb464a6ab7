//! kt's `tracing` events (kt-client's retries, failovers, sources chosen,
//! and the package's own timings) as records of Python's `logging`: the
//! logger `kt` and its children by component (`kt.client.broadcast`,
//! `kt.sync.batch`, `kt.python`, ...).
//!
//! Cheap when disabled: the level of the logger `kt` is read once per call
//! (while the caller holds the GIL) and cached; an event below it is
//! neither formatted nor handed to Python. An event that passes takes the
//! GIL on whichever thread emitted it (kt's runtime threads wait for it
//! while the caller's thread has let it go during a call); once the
//! interpreter is finalizing, events are dropped.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU8, Ordering};

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// The lowest `logging` level the logger `kt` takes (Python's numbers:
/// 10 debug, 20 info, 30 warning, 40 error; 5 for tracing's trace).
/// Python's default: warnings and above.
static LOWEST: AtomicU8 = AtomicU8::new(30);

/// Python's level number of a tracing level.
fn py_level(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG => 10,
        Level::TRACE => 5,
    }
}

/// This crate's events' target (its library is `_kt`).
const OWN: &str = "_kt";

/// Whether events of `target` are kt's (the workspace's crates).
fn is_kt(target: &str) -> bool {
    target.starts_with("kt_") || target == OWN || target.starts_with("_kt::")
}

/// The logger of an event's target: `kt_client::broadcast` ->
/// `kt.client.broadcast`; this crate's -> `kt.python`.
fn logger_name(target: &str) -> String {
    let mut name = String::from("kt");
    let rest = match target.strip_prefix(OWN) {
        Some(rest) if rest.is_empty() || rest.starts_with("::") => {
            name.push_str(".python");
            rest
        }
        _ => target.strip_prefix("kt_").unwrap_or(target),
    };
    for part in rest.split("::").filter(|p| !p.is_empty()) {
        name.push('.');
        name.push_str(part);
    }
    name
}

/// Reads the level of the logger `kt` again (at the start of each call).
pub fn refresh(py: Python<'_>) {
    let lowest = (|| -> PyResult<u8> {
        let logger = py.import("logging")?.call_method1("getLogger", ("kt",))?;
        for level in [5u8, 10, 20, 30, 40] {
            if logger.call_method1("isEnabledFor", (level,))?.extract()? {
                return Ok(level);
            }
        }
        Ok(u8::MAX)
    })()
    .unwrap_or(30);
    LOWEST.store(lowest, Ordering::Relaxed);
}

/// An event's message and fields as one line: `message k=v k=v`.
#[derive(Default)]
struct Line {
    message: String,
    fields: String,
}

impl Visit for Line {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

/// The layer that hands kt's events to `logging`.
struct ToPython;

impl<S: Subscriber> Layer<S> for ToPython {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        // The level may change between calls: asked every time.
        if meta.is_event() && is_kt(meta.target()) {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        meta.is_event()
            && is_kt(meta.target())
            && py_level(meta.level()) >= LOWEST.load(Ordering::Relaxed)
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        let mut line = Line::default();
        event.record(&mut line);
        let text = format!("{}{}", line.message, line.fields);
        let level = py_level(meta.level());
        let name = logger_name(meta.target());
        let _ = Python::try_attach(|py| {
            let logger = py
                .import("logging")?
                .call_method1("getLogger", (name.as_str(),))?;
            if logger.call_method1("isEnabledFor", (level,))?.extract()? {
                logger.call_method1("log", (level, "%s", text))?;
            }
            PyResult::Ok(())
        });
    }
}

/// Sends this process's kt events to `logging` (unless the process already
/// has a tracing subscriber).
pub fn install() {
    let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry().with(ToPython));
}
