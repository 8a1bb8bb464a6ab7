//! Plumbing shared by the kt servers.
//!
//! - [`serve`]: run a router on a bound listener until a shutdown token fires,
//!   with a cap on concurrent requests, then drain; [`conn`]: each
//!   connection's head timeout and the cap on open connections;
//! - [`ApiError`]: the one `ErrorCode -> HTTP status` mapping and JSON error body;
//! - [`ApiJson`]: a JSON extractor whose rejections are [`ApiError`]s;
//! - [`auth`]: bearer-token middleware (everything but `/healthz` and `/readyz`);
//! - [`capability`]: single-key read capabilities the metadata server signs
//!   and peer sources check (no bearer token goes to a peer);
//! - [`metrics`]: Prometheus counters every server exposes on `/metrics`;
//!   [`route_metrics`]: RED per route (rate, errors by status, latency to
//!   the body's end); [`exposition`]: the Prometheus text format;
//! - [`reads`]: the read half of the sync protocol (read leases, batch streams,
//!   ranges) over any [`reads::ReadSource`]: the store and node agents;
//! - [`telemetry`]: logging set-up (OTLP export with feature `otlp`) and
//!   the signal handler;
//! - [`trace`]: each request in a span naming its trace (`traceparent`),
//!   in its log lines, error body and onward calls;
//! - [`tls`]: HTTPS (`--tls-cert`, `--tls-key`), certificates reloaded as
//!   they are renewed.

pub mod auth;
pub mod capability;
pub mod cli;
pub mod conn;
pub mod error;
pub mod exposition;
pub mod metrics;
pub mod reads;
pub mod route_metrics;
pub mod telemetry;
pub mod tls;
pub mod trace;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use futures::StreamExt;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use auth::{Auth, Token, allow, check_read, forbidden, only};
pub use error::{ApiBytes, ApiError, ApiJson, BodyBudget, BodyPermit};
pub use metrics::Metrics;
pub use reads::{blocking, sync_err};

/// Readiness flag answered on `/readyz`.
#[derive(Debug, Clone, Default)]
pub struct Ready(Arc<AtomicBool>);

impl Ready {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }
    pub fn get(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Routes only admin calls (operators, the scenario runner).
pub const ADMIN: &[kt_types::auth::Role] = &[];

/// How long a request body may send nothing before the request fails (a
/// client that opens a body and stalls holds a request slot until then).
pub const BODY_IDLE: std::time::Duration = std::time::Duration::from_secs(30);

/// Wraps a server's API routes with health, metrics, auth and limits: at
/// most `max_in_flight` API requests at once (more wait), each body idle
/// for at most [`BODY_IDLE`]. `/healthz` and `/readyz` are outside the
/// limit: a server busy with slow or many requests still answers them.
pub fn app(
    api: Router,
    auth: impl Into<Auth>,
    metrics: Arc<Metrics>,
    ready: Ready,
    max_in_flight: usize,
) -> Router {
    app_with(api, auth, metrics, ready, (max_in_flight, BODY_IDLE))
}

/// [`app`] with the body idle timeout given (tests).
pub fn app_with(
    api: Router,
    auth: impl Into<Auth>,
    metrics: Arc<Metrics>,
    ready: Ready,
    (max_in_flight, body_idle): (usize, std::time::Duration),
) -> Router {
    let metrics_route = Router::new()
        .route(
            "/metrics",
            allow(
                &[kt_types::auth::Role::Metrics],
                get(metrics::serve_metrics),
            ),
        )
        .with_state(metrics.clone());
    // The fallback sits behind auth too: without a token, every path but health is 401.
    let protected = api
        .merge(metrics_route)
        .fallback(|| async { ApiError::not_found("no such route") })
        .layer(axum::middleware::from_fn_with_state(
            auth.into(),
            auth::require_token,
        ))
        .layer(axum::middleware::from_fn_with_state(
            body_idle,
            idle_bodies_fail,
        ))
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
            max_in_flight.max(1),
        ));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(ready)
        .merge(protected)
        .layer(axum::middleware::from_fn_with_state(
            metrics,
            metrics::count_requests,
        ))
}

/// Makes the request's body fail once it has sent nothing for `idle`: the
/// handler reading it gets an error and the request's slot is freed (a
/// middleware: `from_fn_with_state(idle, idle_bodies_fail)`).
pub async fn idle_bodies_fail(
    State(idle): State<std::time::Duration>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let (parts, body) = req.into_parts();
    let body = IdleBody {
        frames: body.into_data_stream(),
        idle,
        last: tokio::time::Instant::now(),
        timer: Box::pin(tokio::time::sleep(idle)),
    };
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from_stream(body),
    ))
    .await
}

/// A body's data that fails after `idle` without a frame. The timer is
/// moved on only when it fires (not per frame): a fast upload pays one
/// clock read per frame.
struct IdleBody {
    frames: axum::body::BodyDataStream,
    idle: std::time::Duration,
    last: tokio::time::Instant,
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl futures::Stream for IdleBody {
    type Item = Result<bytes::Bytes, axum::Error>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        if let Poll::Ready(frame) = self.frames.poll_next_unpin(cx) {
            self.last = tokio::time::Instant::now();
            return Poll::Ready(frame);
        }
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let deadline = self.last + self.idle;
            if tokio::time::Instant::now() >= deadline {
                let secs = self.idle.as_secs_f64();
                return Poll::Ready(Some(Err(axum::Error::new(format!(
                    "the request body sent nothing for {secs:.0} s"
                )))));
            }
            // Frames came since the timer was set: wait from the last one.
            self.timer.as_mut().reset(deadline);
        }
    }
}

async fn readyz(State(ready): State<Ready>) -> (StatusCode, &'static str) {
    if ready.get() {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}

/// Serves `app` on `listener` until `shutdown` is cancelled, then stops accepting
/// and lets in-flight requests finish for at most `drain`; requests still running
/// after that are dropped (their transfers abort; nothing half-written is published).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: CancellationToken,
    drain: std::time::Duration,
) -> std::io::Result<()> {
    serve_tls(listener, app, shutdown, drain, None).await
}

/// [`serve`], over TLS when `tls` is given ([`tls::TlsListener`]).
pub async fn serve_tls(
    listener: TcpListener,
    app: Router,
    shutdown: CancellationToken,
    drain: std::time::Duration,
    tls: Option<&tls::Tls>,
) -> std::io::Result<()> {
    serve_tls_with(listener, app, shutdown, drain, tls, conn::Conns::default()).await
}

/// [`serve_tls`] with each connection's limits given ([`conn::Conns`]).
pub async fn serve_tls_with(
    listener: TcpListener,
    app: Router,
    shutdown: CancellationToken,
    drain: std::time::Duration,
    tls: Option<&tls::Tls>,
    conns: conn::Conns,
) -> std::io::Result<()> {
    let served = match tls {
        Some(t) => {
            let listener = tls::TlsListener::new(listener, t)?;
            conn::serve_on(listener, app, shutdown, drain, conns).await
        }
        None => conn::serve_on(listener, app, shutdown, drain, conns).await,
    };
    // The spans of the last requests leave before the process does (OTLP
    // export; nothing to do without it), but a collector that does not
    // answer may not hold the shutdown past a few seconds.
    let flush = kt_sync::task::spawn(telemetry::flush_traces);
    if tokio::time::timeout(std::time::Duration::from_secs(5), flush)
        .await
        .is_err()
    {
        tracing::warn!(
            "the OTLP collector did not take the last spans within 5 s; leaving without them"
        );
    }
    served
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Two slots, bodies idle for at most 300 ms: both slots taken by
    /// uploads that stall after three bytes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stalled_bodies_neither_block_health_nor_hold_their_slots() {
        let api = Router::new().route(
            "/api/v1/echo",
            axum::routing::post(|body: bytes::Bytes| async move { body.len().to_string() }),
        );
        let ready = Ready::default();
        ready.set(true);
        let app = app_with(
            api,
            Token::new("t").unwrap(),
            Arc::new(Metrics::new()),
            ready,
            (2, Duration::from_millis(300)),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve(listener, app, stop.clone(), Duration::from_secs(1)));
        let mut stalled = Vec::new();
        for _ in 0..2 {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(
                b"POST /api/v1/echo HTTP/1.1\r\nhost: x\r\nauthorization: Bearer t\r\ncontent-length: 100\r\n\r\nabc",
            )
            .await
            .unwrap();
            stalled.push(s);
        }
        let http = kt_api::client_builder()
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        let health = http
            .get(format!("http://{addr}/healthz"))
            .send()
            .await
            .expect("/healthz answers while every API slot is taken");
        assert_eq!(health.status(), 200);
        // The stalled bodies fail, which frees their slots for the next call.
        let echoed = http
            .post(format!("http://{addr}/api/v1/echo"))
            .bearer_auth("t")
            .body("hello")
            .send()
            .await
            .expect("an API call once the stalled bodies have failed");
        assert_eq!(echoed.text().await.unwrap(), "5");
        for mut s in stalled {
            let mut answer = vec![0u8; 64];
            let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut answer))
                .await
                .expect("the stalled upload is answered")
                .unwrap();
            let head = String::from_utf8_lossy(&answer[..n]).to_string();
            assert!(head.starts_with("HTTP/1.1 4"), "{head}");
        }
        stop.cancel();
        server.await.unwrap().unwrap();
    }

    /// A budget of 1 MiB for buffered bodies: one body of 800 KiB at a time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn buffered_bodies_share_one_budget() {
        let api = Router::new()
            .route(
                "/api/v1/plan",
                axum::routing::post(|ApiBytes(body, _held): ApiBytes| async move {
                    body.len().to_string()
                }),
            )
            .layer(axum::Extension(BodyBudget::new(1 << 20)))
            .layer(axum::extract::DefaultBodyLimit::max(4 << 20));
        let app = app_with(
            api,
            Token::new("t").unwrap(),
            Arc::new(Metrics::new()),
            Ready::default(),
            (16, Duration::from_millis(500)),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve(listener, app, stop.clone(), Duration::from_secs(1)));
        let http = kt_api::client_builder()
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        let post = |body: Vec<u8>| {
            http.post(format!("http://{addr}/api/v1/plan"))
                .bearer_auth("t")
                .body(body)
                .send()
        };
        // Larger than the whole budget: refused at once, before a byte of
        // it is read.
        let mut large = tokio::net::TcpStream::connect(addr).await.unwrap();
        large
            .write_all(b"POST /api/v1/plan HTTP/1.1\r\nhost: x\r\nauthorization: Bearer t\r\ncontent-length: 2097152\r\n\r\n")
            .await
            .unwrap();
        let mut answer = vec![0u8; 4096];
        let n = large.read(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]).to_string();
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert!(answer.contains("1048576"), "{answer}");
        // One stalled 800 KiB body holds the budget: the next waits for it
        // to fail (idle), then goes through.
        let mut stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
        stalled
            .write_all(b"POST /api/v1/plan HTTP/1.1\r\nhost: x\r\nauthorization: Bearer t\r\ncontent-length: 819200\r\n\r\nabc")
            .await
            .unwrap();
        let mut answer = vec![0u8; 64];
        let next = post(vec![1; 800 << 10]);
        let (next, read) = tokio::join!(next, stalled.read(&mut answer));
        let n = read.unwrap();
        assert!(String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 4"));
        assert_eq!(next.unwrap().text().await.unwrap(), (800 << 10).to_string());
        stop.cancel();
        server.await.unwrap().unwrap();
    }
}
