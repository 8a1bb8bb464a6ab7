//! RED metrics per matched route: requests by status (rate and errors) and
//! a latency histogram timed to the end of the response body.
//!
//! Labels are bounded: the route is axum's matched template
//! (`/api/v1/keys/{*key}`, never a key) or `unmatched`, the method one of
//! the standard ones or `OTHER`. A streamed body (a get's batch stream) is
//! timed until its last frame is sent, or until the client goes away (the
//! body is dropped), not until its headers are.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{MatchedPath, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use prometheus_client::metrics::histogram::Histogram;

use crate::metrics::{Metrics, RequestLabels, RouteLabels};

/// The upper bounds of the latency buckets, in seconds: 0.5 ms to ~65 s.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.0005, 2.0, 18)
}

/// A method as a bounded label value.
fn method_label(m: &Method) -> &'static str {
    match *m {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        _ => "OTHER",
    }
}

/// Counts each request by route, method and status when its headers are
/// ready, and observes its duration when its body has been sent.
pub async fn count_requests(State(m): State<Arc<Metrics>>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = method_label(req.method());
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let resp = next.run(req).await;
    m.requests
        .get_or_create(&RequestLabels {
            method: method.to_owned(),
            route: route.clone(),
            status: resp.status().as_u16(),
        })
        .inc();
    let histogram = m
        .durations
        .get_or_create(&RouteLabels {
            method: method.to_owned(),
            route,
        })
        .clone();
    let (parts, body) = resp.into_parts();
    let body = TimedBody {
        inner: body,
        timer: Some((histogram, started)),
    };
    Response::from_parts(parts, Body::new(body))
}

/// A response body that observes its request's duration once: at its end
/// (the last frame or an error) or when dropped unfinished.
struct TimedBody {
    inner: Body,
    timer: Option<(Histogram, Instant)>,
}

impl TimedBody {
    fn observe(&mut self) {
        if let Some((h, started)) = self.timer.take() {
            h.observe(started.elapsed().as_secs_f64());
        }
    }
}

impl Drop for TimedBody {
    fn drop(&mut self) {
        self.observe();
    }
}

impl HttpBody for TimedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            self.observe();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::Router;
    use axum::routing::get;
    use tower::ServiceExt;

    use super::*;

    /// A body that sends its last byte 300 ms after its headers is timed
    /// to that byte; the route label is the template, not the path.
    #[tokio::test]
    async fn a_streamed_body_is_timed_to_its_end() {
        let metrics = Arc::new(Metrics::new());
        let app = Router::new()
            .route(
                "/slow/{id}",
                get(|| async {
                    let frames = futures::stream::unfold(0, |i| async move {
                        match i {
                            0 => Some((Ok::<_, std::io::Error>(Bytes::from("a")), 1)),
                            1 => {
                                tokio::time::sleep(Duration::from_millis(300)).await;
                                Some((Ok(Bytes::from("b")), 2))
                            }
                            _ => None,
                        }
                    });
                    Body::from_stream(frames)
                }),
            )
            .layer(axum::middleware::from_fn_with_state(
                metrics.clone(),
                count_requests,
            ));
        let req = Request::builder()
            .uri("/slow/secret-key-42")
            .body(Body::empty())
            .unwrap();
        let resp = app.oneshot(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let text = metrics.encode();
        // Headers are out, the body is not: nothing is observed yet.
        assert!(
            text.contains(
                r#"kt_http_request_duration_seconds_count{method="GET",route="/slow/{id}"} 0"#
            ),
            "{text}"
        );
        let body = axum::body::to_bytes(resp.into_body(), 1024).await.unwrap();
        assert_eq!(&body[..], b"ab");
        let text = metrics.encode();
        assert!(
            text.contains(
                r#"kt_http_requests_total{method="GET",route="/slow/{id}",status="200"} 1"#
            ),
            "{text}"
        );
        assert!(!text.contains("secret-key-42"), "{text}");
        let sum = text
            .lines()
            .find_map(|l| {
                l.strip_prefix(
                    r#"kt_http_request_duration_seconds_sum{method="GET",route="/slow/{id}"} "#,
                )
            })
            .and_then(|v| v.parse::<f64>().ok())
            .expect("a duration sum");
        assert!(sum >= 0.3, "timed to the body's end: {sum} s\n{text}");
    }

    #[test]
    fn odd_methods_share_one_label() {
        assert_eq!(method_label(&Method::GET), "GET");
        let odd = Method::from_bytes(b"BREW").unwrap();
        assert_eq!(method_label(&odd), "OTHER");
    }
}
