//! Plumbing shared by the kt servers.
//!
//! - [`serve`]: run a router on a bound listener until a shutdown token fires,
//!   with a cap on concurrent requests, then drain;
//! - [`ApiError`]: the one `ErrorCode -> HTTP status` mapping and JSON error body;
//! - [`ApiJson`]: a JSON extractor whose rejections are [`ApiError`]s;
//! - [`auth`]: bearer-token middleware (everything but `/healthz` and `/readyz`);
//! - [`capability`]: single-key read capabilities the metadata server signs
//!   and peer sources check (no bearer token goes to a peer);
//! - [`metrics`]: Prometheus counters every server exposes on `/metrics`;
//! - [`reads`]: the read half of the sync protocol (read leases, batch streams,
//!   ranges) over any [`reads::ReadSource`]: the store and node agents;
//! - [`telemetry`]: logging set-up and the signal handler;
//! - [`tls`]: HTTPS (`--tls-cert`, `--tls-key`), certificates reloaded as
//!   they are renewed.

pub mod auth;
pub mod capability;
pub mod cli;
pub mod error;
pub mod metrics;
pub mod reads;
pub mod telemetry;
pub mod tls;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use auth::{Auth, Token, allow, check_read, forbidden, only};
pub use error::{ApiBytes, ApiError, ApiJson};
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

/// Wraps a server's API routes with health, metrics, auth and limits.
pub fn app(
    api: Router,
    auth: impl Into<Auth>,
    metrics: Arc<Metrics>,
    ready: Ready,
    max_in_flight: usize,
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
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
            max_in_flight.max(1),
        ))
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
    match tls {
        Some(t) => serve_on(tls::TlsListener::new(listener, t)?, app, shutdown, drain).await,
        None => serve_on(listener, app, shutdown, drain).await,
    }
}

async fn serve_on<L>(
    listener: L,
    app: Router,
    shutdown: CancellationToken,
    drain: std::time::Duration,
) -> std::io::Result<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let stop = shutdown.clone();
    let server =
        axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await });
    let deadline = async move {
        shutdown.cancelled().await;
        tokio::time::sleep(drain).await;
    };
    tokio::select! {
        r = server => r,
        _ = deadline => {
            tracing::warn!(?drain, "in-flight requests did not finish in time; aborting them");
            Ok(())
        }
    }
}
