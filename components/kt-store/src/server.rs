//! Wiring: configuration, shared state, routes, background sweepers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{delete, get, post, put};
use kt_service::reads::Reads;
use kt_service::{Metrics, Ready};
use kt_sync::SyncError;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::keys::Keys;
use crate::registrar::Registrar;
use crate::state::{AppState, Config, Shared};
use crate::versions::StoreVersions;
use crate::{put, trees};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("data directory: {0}")]
    Data(#[from] SyncError),
    #[error("serving: {0}")]
    Serve(#[from] std::io::Error),
    #[error("configuration: {0}")]
    Config(String),
}

/// A running store: its counters and its task.
#[derive(Debug)]
pub struct StoreHandle {
    pub metrics: Arc<Metrics>,
    pub url: String,
    pub task: JoinHandle<Result<(), StoreError>>,
}

fn advertised(addr: SocketAddr, configured: Option<&str>, https: bool) -> String {
    if let Some(u) = configured {
        return u.trim_end_matches('/').to_owned();
    }
    let host = if addr.ip().is_unspecified() {
        tracing::warn!(
            "listening on an unspecified address; advertising 127.0.0.1 (set --advertise-url)"
        );
        "127.0.0.1".to_owned()
    } else {
        addr.ip().to_string()
    };
    let scheme = if https { "https" } else { "http" };
    format!("{scheme}://{host}:{}", addr.port())
}

/// Opens the data directory and starts serving on `listener` in a task.
pub fn start(
    listener: TcpListener,
    cfg: Config,
    shutdown: CancellationToken,
) -> Result<StoreHandle, StoreError> {
    kt_sync::chunk::check_chunk_size(cfg.chunk_size)?;
    let keys = Arc::new(Keys::open(&cfg.data_dir, cfg.session_ttl)?);
    let url = advertised(
        listener.local_addr()?,
        cfg.advertise_url.as_deref(),
        cfg.server.tls.is_some(),
    );
    let registrar = Arc::new(
        Registrar::new(&cfg.metadata_url, &url, cfg.server.token.clone())
            .map_err(StoreError::Config)?,
    );
    let metrics = Arc::new(Metrics::new());
    let reads = Reads::new(
        StoreVersions {
            keys: keys.clone(),
            chunk_size: cfg.chunk_size,
        },
        registrar.clone(),
        metrics.clone(),
        cfg.lease_ttl,
    );
    let shared = Arc::new(Shared {
        keys,
        puts: Default::default(),
        reads,
        metrics: metrics.clone(),
        registrar,
        url: url.clone(),
        cfg,
    });
    metrics.attach(Arc::new(crate::metrics::StoreGauges(Arc::downgrade(
        &shared,
    ))));
    let task = tokio::spawn(serve(listener, shared, shutdown));
    Ok(StoreHandle { metrics, url, task })
}

/// Runs the store until `shutdown` is cancelled.
pub async fn run(
    listener: TcpListener,
    cfg: Config,
    shutdown: CancellationToken,
) -> Result<(), StoreError> {
    let handle = start(listener, cfg, shutdown)?;
    handle
        .task
        .await
        .map_err(|e| StoreError::Config(format!("store task failed: {e}")))?
}

fn routes(state: AppState) -> Router {
    let json_limit = state.cfg.max_request_bytes;
    // Applications put; the metadata server (admin) deletes and lists.
    use kt_service::{ADMIN, allow};
    use kt_types::auth::Role::Workload;
    const W: &[kt_types::auth::Role] = &[Workload];
    Router::new()
        .route("/api/v1/puts", allow(W, post(put::plan)))
        .route("/api/v1/puts/{session}/batch", allow(W, put(put::batch)))
        .route(
            "/api/v1/puts/{session}/files/{index}/chunks/{n}",
            // Streamed; the handler refuses bytes beyond the chunk's length.
            allow(W, put(put::chunk)),
        )
        .route("/api/v1/puts/{session}/commit", allow(W, post(put::commit)))
        .route("/api/v1/puts/{session}", allow(W, delete(put::abort)))
        .route("/api/v1/trees", allow(ADMIN, get(trees::list)))
        .route(
            "/api/v1/trees/{*key}",
            allow(ADMIN, delete(trees::delete_tree)),
        )
        .with_state(state.clone())
        // GET /api/v1/trees/{key} and /api/v1/reads/...
        .merge(state.reads.routes())
        .layer(DefaultBodyLimit::max(json_limit))
        // Put plans (the manifest document) are buffered: together, at
        // most one largest body's worth, however many come at once.
        .layer(axum::Extension(kt_service::BodyBudget::new(
            json_limit as u64,
        )))
}

async fn serve(
    listener: TcpListener,
    s: AppState,
    shutdown: CancellationToken,
) -> Result<(), StoreError> {
    let ready = Ready::default();
    let app = kt_service::app(
        routes(s.clone()),
        s.cfg.server.callers(),
        s.metrics.clone(),
        ready.clone(),
        s.cfg.server.max_in_flight,
    );
    let app = kt_service::trace::layer(app, "store");
    tracing::info!(addr = %listener.local_addr()?, url = %s.url, data_dir = %s.cfg.data_dir.display(), "store listening");
    let background = tokio::spawn(background(s.clone(), ready, shutdown.clone()));
    let served = kt_service::serve_tls(
        listener,
        app,
        shutdown.clone(),
        s.cfg.drain,
        s.cfg.server.tls.as_ref(),
    )
    .await;
    shutdown.cancel();
    let _ = background.await;
    served?;
    Ok(())
}

/// Registration with the metadata server, then periodic sweeps of idle leases
/// and sessions and retries of pending registrations.
async fn background(s: AppState, ready: Ready, shutdown: CancellationToken) {
    let announce = async {
        s.registrar.announce_until_ok(&shutdown).await;
        crate::reconcile::all_keys(&s).await;
        ready.set(true);
    };
    tokio::select! {
        _ = shutdown.cancelled() => return,
        _ = announce => {}
    }
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        crate::reconcile::retry_pending(&s).await;
        s.reads.sweep(Instant::now()).await;
        put::sweep(&s, Instant::now()).await;
    }
    // Unfinished uploads keep their staging areas: resumed after the restart.
    put::interrupt_all(&s).await;
}
