//! Logging (text or JSON lines, each carrying the request's trace id), OTLP
//! export of traces when asked for (feature `otlp`), and signals.

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
/// of `KT_LOG`), defaulting to `info`. Each line written inside a request
/// carries its `trace_id` ([`crate::trace`]).
///
/// With `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
/// set, and `OTEL_SDK_DISABLED` not `true`, spans are also exported over
/// OTLP (HTTP, protobuf) in builds with the `otlp` feature (the servers');
/// nothing of it runs otherwise.
pub fn init_logging(filter: Option<&str>, format: Option<&str>) {
    use tracing_subscriber::util::SubscriberInitExt;
    let json = match format {
        Some("json") => true,
        Some("text") => false,
        _ => !std::io::stderr().is_terminal(),
    };
    let logs = subscriber(filter, json, stderr_color(), std::io::stderr);
    let wanted = otlp_wanted(|name| std::env::var(name).ok());
    #[cfg(feature = "otlp")]
    {
        use tracing_subscriber::layer::SubscriberExt;
        let (layer, failed) = match wanted.then(|| otlp::layer(None)) {
            Some(Ok(layer)) => (Some(layer), None),
            Some(Err(e)) => (None, Some(e)),
            None => (None, None),
        };
        let _ = logs.with(layer).try_init();
        if let Some(e) = failed {
            tracing::warn!(error = %e, "OTLP export is off: its exporter could not be built");
        }
    }
    #[cfg(not(feature = "otlp"))]
    {
        let _ = logs.try_init();
        if wanted {
            tracing::warn!("OTEL_EXPORTER_OTLP_ENDPOINT is set, but this build has no OTLP export");
        }
    }
}

/// Whether the standard variables ask for OTLP export of traces.
fn otlp_wanted(var: impl Fn(&str) -> Option<String>) -> bool {
    let set = |name: &str| var(name).is_some_and(|v| !v.trim().is_empty());
    let disabled = var(kt_types::env::OTEL_SDK_DISABLED).is_some_and(|v| v.trim() == "true");
    !disabled
        && (set(kt_types::env::OTEL_EXPORTER_OTLP_ENDPOINT)
            || set(kt_types::env::OTEL_EXPORTER_OTLP_TRACES_ENDPOINT))
}

/// The log subscriber of [`init_logging`], writing to `writer` (tests
/// give their own): the filter, then JSON lines (each event's fields at
/// the top level, its spans' under `span` and `spans`) or text.
pub fn subscriber<W>(
    filter: Option<&str>,
    json: bool,
    ansi: bool,
    writer: W,
) -> impl tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a> + Send + Sync
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    let filter =
        EnvFilter::try_new(filter.unwrap_or("info")).unwrap_or_else(|_| EnvFilter::new("info"));
    let format = tracing_subscriber::fmt::layer()
        .with_ansi(ansi && !json)
        .with_writer(writer);
    let format = if json {
        format.json().flatten_event(true).boxed()
    } else {
        format.boxed()
    };
    tracing_subscriber::registry().with(filter).with(format)
}

/// With OTLP export on: has `span` continue `parent` (a remote span), and
/// answers the trace it runs as, with the exported span's id. `None` when
/// export is off (then the caller makes its own ids).
pub fn adopt(
    span: &tracing::Span,
    parent: Option<kt_api::trace::TraceParent>,
) -> Option<kt_api::trace::TraceParent> {
    #[cfg(feature = "otlp")]
    {
        otlp::adopt(span, parent)
    }
    #[cfg(not(feature = "otlp"))]
    {
        let _ = (span, parent);
        None
    }
}

/// Sends the spans not yet exported (at exit; tests). Nothing without
/// OTLP export.
pub fn flush_traces() {
    #[cfg(feature = "otlp")]
    otlp::flush();
}

/// OTLP export of the `tracing` spans (feature `otlp`).
#[cfg(feature = "otlp")]
pub mod otlp {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicBool, Ordering};

    use kt_api::trace::TraceParent;
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider,
    };
    use opentelemetry_otlp::WithExportConfig;
    use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
    use tracing_opentelemetry::{OpenTelemetryLayer, OpenTelemetrySpanExt};

    static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();
    /// A layer was made: [`adopt`] has work to do (one load when off).
    static ON: AtomicBool = AtomicBool::new(false);

    /// The layer exporting spans to `endpoint` (the whole URL, e.g.
    /// `http://collector:4318/v1/traces`), or where the standard
    /// variables say (`None`: `OTEL_EXPORTER_OTLP_ENDPOINT` plus
    /// `/v1/traces`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, headers,
    /// timeout). Spans go in batches from a thread of their own. The
    /// service name is `OTEL_SERVICE_NAME`, else the program's name.
    pub fn layer<S>(endpoint: Option<&str>) -> Result<OpenTelemetryLayer<S, SdkTracer>, String>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
        if let Some(e) = endpoint {
            exporter = exporter.with_endpoint(e);
        }
        let exporter = exporter.build().map_err(|e| e.to_string())?;
        let mut resource = opentelemetry_sdk::Resource::builder();
        if std::env::var_os(kt_types::env::OTEL_SERVICE_NAME).is_none() {
            let program = std::env::current_exe()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "kt".to_owned());
            resource = resource.with_service_name(program);
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build();
        let tracer = provider.tracer("kt");
        if PROVIDER.set(provider).is_err() {
            return Err("OTLP export is already set up in this process".to_owned());
        }
        ON.store(true, Ordering::Release);
        Ok(tracing_opentelemetry::layer().with_tracer(tracer))
    }

    pub(crate) fn adopt(span: &tracing::Span, parent: Option<TraceParent>) -> Option<TraceParent> {
        if !ON.load(Ordering::Acquire) {
            return None;
        }
        if let Some(p) = parent {
            // The caller's sampled flag is not obeyed: any workload may send
            // a `traceparent`, and `-00` would keep its requests (and the
            // calls they cause on other servers) out of the exported traces.
            // This server samples by its own rule (every request).
            let remote = SpanContext::new(
                TraceId::from_bytes(p.trace_id().0.to_be_bytes()),
                SpanId::from_bytes(p.span_id().to_be_bytes()),
                TraceFlags::SAMPLED,
                true,
                TraceState::default(),
            );
            // Fails only where the span is not exported (filtered out, or
            // a subscriber without the layer): then our own ids serve.
            span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote))
                .ok()?;
        }
        let cx = span.context();
        let own = cx.span().span_context().clone();
        if !own.is_valid() {
            return None;
        }
        TraceParent::from_parts(
            u128::from_be_bytes(own.trace_id().to_bytes()),
            u64::from_be_bytes(own.span_id().to_bytes()),
            own.is_sampled(),
        )
    }

    pub(crate) fn flush() {
        if let Some(p) = PROVIDER.get()
            && let Err(e) = p.force_flush()
        {
            tracing::warn!(error = %e, "exporting the last spans failed");
        }
    }
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
    use super::{color_for, otlp_wanted};

    #[test]
    fn otlp_only_when_an_endpoint_is_set_and_the_sdk_is_not_disabled() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        assert!(!otlp_wanted(env(&[])));
        assert!(!otlp_wanted(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])));
        assert!(otlp_wanted(env(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://c:4318"
        )])));
        assert!(otlp_wanted(env(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://c:4318/v1/traces"
        )])));
        assert!(!otlp_wanted(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_SDK_DISABLED", "true"),
        ])));
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(color_for(true, None));
        assert!(!color_for(false, None));
        assert!(!color_for(true, Some("1".as_ref())));
        // An empty NO_COLOR does not count (no-color.org).
        assert!(color_for(true, Some("".as_ref())));
    }
}
