//! OTLP export (feature `otlp`): a request traced by a server's layer
//! reaches an OTLP/HTTP receiver (a small axum server on `127.0.0.1:0`
//! decoding protobuf with `opentelemetry-proto`) as a span of the caller's
//! trace, child of the caller's span, under the span id the request's
//! onward calls carry.

use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::routing::{get, post};
use kt_api::trace::{HEADER, TraceParent};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::sync::mpsc;
use tower::ServiceExt;
use tracing_subscriber::layer::SubscriberExt;

async fn receive(State(spans): State<mpsc::UnboundedSender<Span>>, body: Bytes) -> Vec<u8> {
    let req = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export");
    for rs in req.resource_spans {
        for ss in rs.scope_spans {
            for span in ss.spans {
                let _ = spans.send(span);
            }
        }
    }
    Vec::new()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_receiver_with_the_callers_trace() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let receiver = Router::new()
        .route("/v1/traces", post(receive))
        .with_state(tx);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, receiver).await });

    let endpoint = format!("http://{addr}/v1/traces");
    let otlp = kt_service::telemetry::otlp::layer(Some(&endpoint)).expect("an exporter");
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(otlp)).unwrap();

    let app = kt_service::trace::layer(
        Router::new().route(
            "/api/v1/echo",
            get(|| async { kt_api::trace::current().unwrap().to_string() }),
        ),
        "test",
    );
    // A caller that says "not sampled" (`-00`) is exported all the same: a
    // workload must not keep its requests out of the traces.
    let unsampled = TraceParent::new();
    let unsampled = TraceParent::from_parts(unsampled.trace_id().0, unsampled.span_id(), false)
        .expect("valid ids");
    for parent in [TraceParent::new(), unsampled] {
        let resp = app
            .clone()
            .oneshot(
                axum::http::Request::builder()
                    .uri("/api/v1/echo")
                    .header(HEADER, parent.to_string())
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        let onward = TraceParent::parse(std::str::from_utf8(&body).unwrap()).unwrap();
        assert_eq!(onward.trace_id(), parent.trace_id());
        assert!(onward.sampled(), "onward calls are sampled: {onward}");

        // The batch thread exports on flush (blocking: off the runtime).
        kt_sync::task::spawn(kt_service::telemetry::flush_traces)
            .await
            .unwrap();
        let span = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let span = rx.recv().await.expect("the receiver runs");
                if span.name == "request" {
                    return span;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("the request's span is exported (parent {parent})"));
        assert_eq!(span.trace_id, parent.trace_id().0.to_be_bytes().to_vec());
        assert_eq!(span.parent_span_id, parent.span_id().to_be_bytes().to_vec());
        assert_eq!(span.span_id, onward.span_id().to_be_bytes().to_vec());
    }
}
