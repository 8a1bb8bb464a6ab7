//! Request tracing: every request a server answers runs in a `request`
//! span that names its trace (`trace_id`), so each log line written while
//! it runs carries the id (JSON: under `span`/`spans`; text: in the span
//! prefix), its error body carries it ([`crate::ApiError`]), and the calls
//! the server makes for it carry it on ([`kt_api::trace`]).
//!
//! The trace comes from the request's `traceparent` header when that is
//! well formed ([`TraceParent::parse`]); a missing or malformed one starts
//! a new trace (a malformed value is never echoed). The request runs as a
//! child: the same trace id, a span id of its own, which is the parent id
//! of its outgoing calls. With OTLP export on ([`crate::telemetry`]), that
//! span id is the exported span's.
//!
//! When the request is done, a `debug` event records its status and
//! duration (an access log at `KT_LOG=debug`; free when filtered out).

use std::time::Instant;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use kt_api::trace::{HEADER, TraceParent};
use tracing::Instrument;

/// `app` with each request traced as one of `server`'s (`metadata`,
/// `store`, `agent`, `relay`, …: the span's `server` field, which tells
/// servers apart where several share a process, as in tests).
pub fn layer(app: Router, server: &'static str) -> Router {
    app.layer(axum::middleware::from_fn_with_state(server, trace_request))
}

/// The middleware of [`layer`].
pub async fn trace_request(
    State(server): State<&'static str>,
    req: Request,
    next: Next,
) -> Response {
    let parent = incoming(req.headers());
    let span = tracing::info_span!(
        "request",
        trace_id = tracing::field::Empty,
        server,
        method = %req.method(),
        path = %req.uri().path(),
    );
    let trace = start(&span, parent);
    let started = Instant::now();
    let resp = kt_api::trace::scope(Some(trace), next.run(req))
        .instrument(span.clone())
        .await;
    span.in_scope(|| {
        tracing::debug!(
            status = resp.status().as_u16(),
            elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
            "request"
        );
    });
    resp
}

/// The `traceparent` of a request, if well formed.
pub fn incoming(headers: &axum::http::HeaderMap) -> Option<TraceParent> {
    headers
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse)
}

/// The trace `span` runs as: a child of `parent`, or a new trace; with
/// OTLP export on, the exported span's ids. Records it as the span's
/// `trace_id` field (declared [`tracing::field::Empty`]).
pub fn start(span: &tracing::Span, parent: Option<TraceParent>) -> TraceParent {
    let trace = crate::telemetry::adopt(span, parent)
        .unwrap_or_else(|| parent.map_or_else(TraceParent::new, |p| p.child()));
    span.record("trace_id", tracing::field::display(trace.trace_id()));
    trace
}

/// The trace id of the running request, for an error body.
pub fn current_id() -> Option<String> {
    kt_api::trace::current().map(|t| t.trace_id().to_string())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use axum::body::Body;
    use axum::routing::get;
    use tower::ServiceExt;

    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// A router whose handler answers the trace it runs in, and whose
    /// `/fail` route answers an error.
    fn app() -> Router {
        let api = Router::new()
            .route(
                "/trace",
                get(|| async {
                    kt_api::trace::current()
                        .map(|t| t.to_string())
                        .unwrap_or_default()
                }),
            )
            .route(
                "/fail",
                get(|| async {
                    tracing::warn!("failing");
                    crate::ApiError::not_found("nothing here")
                }),
            );
        layer(api, "test")
    }

    async fn call(app: &Router, path: &str, traceparent: Option<&str>) -> (u16, String) {
        let mut req = Request::builder().uri(path);
        if let Some(t) = traceparent {
            req = req.header(HEADER, t);
        }
        let resp = app
            .clone()
            .oneshot(req.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn a_request_runs_as_a_child_of_a_well_formed_traceparent_only() {
        let app = app();
        let (_, body) = call(&app, "/trace", Some(PARENT)).await;
        let got = TraceParent::parse(&body).expect("the handler runs in a trace");
        let parent = TraceParent::parse(PARENT).unwrap();
        assert_eq!(got.trace_id(), parent.trace_id());
        assert_ne!(got.span_id(), parent.span_id(), "a span of its own");

        // Malformed: a new trace, nothing of the value kept.
        for bad in [
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}",
            "garbage",
        ] {
            let (_, body) = call(&app, "/trace", Some(bad)).await;
            let got = TraceParent::parse(&body).expect("a new trace");
            assert_ne!(got.trace_id(), parent.trace_id(), "{bad}");
        }
        let (_, a) = call(&app, "/trace", None).await;
        let (_, b) = call(&app, "/trace", None).await;
        assert_ne!(
            TraceParent::parse(&a).unwrap().trace_id(),
            TraceParent::parse(&b).unwrap().trace_id()
        );
    }

    /// A writer the formatter writes lines into.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Lines {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    /// Both log formats carry the trace id on a line logged inside a
    /// request, and the error body carries it too.
    #[test]
    fn log_lines_and_error_bodies_carry_the_trace_id() {
        let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
        for json in [true, false] {
            let lines = Lines::default();
            let writer = lines.clone();
            let subscriber =
                crate::telemetry::subscriber(Some("debug"), json, false, move || writer.clone());
            let (status, body) = tracing::subscriber::with_default(subscriber, || {
                tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap()
                    .block_on(call(&app(), "/fail", Some(PARENT)))
            });
            assert_eq!(status, 404);
            let body: kt_types::ErrorBody = serde_json::from_str(&body).unwrap();
            assert_eq!(body.error.trace_id.as_deref(), Some(trace_id));
            let text = lines.text();
            let failing: Vec<&str> = text.lines().filter(|l| l.contains("failing")).collect();
            assert_eq!(failing.len(), 1, "{text}");
            if json {
                let line: serde_json::Value = serde_json::from_str(failing[0]).unwrap();
                assert_eq!(line["span"]["trace_id"], trace_id, "{line}");
                assert_eq!(line["span"]["server"], "test", "{line}");
            } else {
                assert!(
                    failing[0].contains(&format!("trace_id={trace_id}")),
                    "{text}"
                );
            }
            // The access log line, at debug.
            assert!(
                text.lines()
                    .any(|l| l.contains("request") && l.contains("404") && l.contains(trace_id)),
                "{text}"
            );
        }
    }
}
