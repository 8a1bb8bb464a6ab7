//! HTTP API of the metadata server, and the WebSocket of broadcast members.
//!
//! This module holds the configuration, the shared state, the router (every
//! route with the roles it allows) and the checks several resources share;
//! the handlers live by resource: [`stores`], [`keys`], [`leases`],
//! [`agents`], [`services`], [`broadcasts`], [`gauges`] (`/status`), and
//! [`sweep`] the background sweeper.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{delete, get, post, put};
use kt_service::cli::ServerConfig;
use kt_service::{ApiError, Metrics, Ready};
use kt_types::api::TeardownResponse;
use kt_types::auth::{Principal, Role};
use kt_types::{ErrorCode, Key};
use tokio::net::TcpListener;
use tokio::sync::{Mutex, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::broadcast::Groups;
use crate::db::{Batch, Db, DbError};
use crate::leases::Leases;
use crate::quorum::{JoinLimits, MAX_JOIN_BODY, Quorums};
use crate::registry::{Registry, SourceError};

mod agents;
mod broadcasts;
mod gauges;
mod keys;
mod leases;
mod services;
mod stores;
mod sweep;

use agents::commit_eviction;
use broadcasts::{Broadcasts, get_broadcast, join_broadcast};
use services::teardown_service;

/// Bytes of request bodies read whole ([`kt_service::ApiBytes`]) held at
/// once: two of the largest quorum join.
const BODY_BUDGET: u64 = 2 * MAX_JOIN_BODY as u64;

/// Everything the server needs besides its listener.
#[derive(Debug, Clone)]
pub struct Config {
    pub state_dir: PathBuf,
    /// What every server takes from the shared flags
    /// ([`kt_service::cli::ServerArgs::load`]): its token, who may call it,
    /// TLS, requests served at once.
    pub server: ServerConfig,
    /// How often expired keys, leases and silent agents are swept.
    pub sweep_interval: Duration,
    /// How often agents are told to beat.
    pub heartbeat_interval: Duration,
    /// An agent silent this long is no longer a source, and is evicted.
    pub agent_ttl: Duration,
    /// How long a source lease lasts unless renewed.
    pub lease_ttl: Duration,
}

impl Config {
    pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
    pub const DEFAULT_AGENT_TTL: Duration = Duration::from_secs(10);
    pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);

    /// Defaults for everything but the state directory and the shared
    /// settings (a [`kt_service::Token`] alone: its holder is admin).
    pub fn new(state_dir: impl Into<PathBuf>, server: impl Into<ServerConfig>) -> Self {
        Config {
            state_dir: state_dir.into(),
            server: server.into(),
            sweep_interval: Duration::from_secs(5),
            heartbeat_interval: Self::DEFAULT_HEARTBEAT_INTERVAL,
            agent_ttl: Self::DEFAULT_AGENT_TTL,
            lease_ttl: Self::DEFAULT_LEASE_TTL,
        }
    }

    fn validate(&self) -> Result<(), MetadataError> {
        let fail = |msg: String| Err(MetadataError::Config(msg));
        if self.heartbeat_interval.is_zero() || self.lease_ttl.is_zero() {
            return fail("the heartbeat interval and the lease TTL must be positive".into());
        }
        if self.agent_ttl <= self.heartbeat_interval {
            return fail(format!(
                "the agent TTL ({:?}) must be longer than the heartbeat interval ({:?}), \
                 or every agent is evicted between two beats",
                self.agent_ttl, self.heartbeat_interval
            ));
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("serving: {0}")]
    Serve(#[from] std::io::Error),
    #[error("http client: {0}")]
    Client(String),
    #[error("configuration: {0}")]
    Config(String),
}

struct Inner {
    registry: Mutex<Registry>,
    leases: Mutex<Leases>,
    store_url: Mutex<Option<String>>,
    /// Never held across an await.
    broadcasts: std::sync::Mutex<Broadcasts>,
    /// Ends the members' WebSocket sessions, which the HTTP drain does not track.
    shutdown: CancellationToken,
    /// The members' sessions, waited for before [`run`] returns.
    sessions: TaskTracker,
    db: Db,
    /// Calls to the store (deletes), with the token; `Api::at` its URL.
    stores: kt_api::Api,
    heartbeat_interval_ms: u64,
    agent_ttl_ms: u64,
    lease_ttl_ms: u64,
    /// Signs the capabilities getters show peer sources
    /// ([`kt_service::capability`]).
    signer: kt_service::capability::Signer,
    /// The server's counters (`/metrics`), which tasks beside it share.
    metrics: Arc<Metrics>,
    /// Dropped last, after the database closed: tells [`run`] it may return.
    _closed: oneshot::Sender<()>,
}

type AppState = Arc<Inner>;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn db_err(e: DbError) -> ApiError {
    ApiError::internal(e.to_string())
}

impl From<SourceError> for ApiError {
    fn from(e: SourceError) -> Self {
        let code = match e {
            SourceError::UnknownKey(_) | SourceError::Stale { .. } => ErrorCode::NotFound,
            SourceError::NoSource { .. } => ErrorCode::NoSource,
            SourceError::Tensors(_) => ErrorCode::InvalidRequest,
        };
        ApiError::new(code, e.to_string())
    }
}

/// Runs the metadata server on `listener` until `shutdown` is cancelled.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), MetadataError> {
    run_with(listener, config, shutdown, |_| async {}).await
}

/// What a task running beside the server (the cluster watch) may do to it.
#[derive(Clone)]
pub struct Handle(AppState);

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Handle")
    }
}

impl Handle {
    /// Cancelled when the server stops: the task must end then.
    pub fn shutdown(&self) -> CancellationToken {
        self.0.shutdown.clone()
    }

    /// The server's counters: what a task beside it serves is counted
    /// on the server's `/metrics`.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.0.metrics.clone()
    }

    /// The registry's live agents.
    pub async fn agents(&self) -> Vec<kt_types::api::AgentInfo> {
        self.0.registry.lock().await.agents(now_ms())
    }

    /// Evicts agents by id, as the sweep evicts silent ones (a later
    /// heartbeat brings a live one back); the ids evicted.
    pub async fn evict_agents(&self, ids: &[String], why: &str) -> Result<Vec<String>, DbError> {
        let mut registry = self.0.registry.lock().await;
        let eviction = registry.evict(ids);
        commit_eviction(&self.0, &eviction, why)?;
        Ok(eviction.agents)
    }

    /// Tears a service down, as `DELETE /api/v1/services/{name}`.
    pub async fn teardown(&self, service: &str) -> Result<TeardownResponse, ApiError> {
        teardown_service(&self.0, service).await
    }
}

/// The registry says which service owns a key (quorum getters' keys).
impl kt_service::reads::Owners for Handle {
    fn service_of<'a>(
        &'a self,
        key: &'a Key,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<String, ApiError>> + Send + 'a>>
    {
        Box::pin(async move {
            let registry = self.0.registry.lock().await;
            registry
                .get(key, now_ms())
                .map(|r| r.service.clone())
                .ok_or_else(|| ApiError::not_found(format!("key {key} not found")))
        })
    }
}

/// [`run`], with `attach` started beside the server once it is set up: it is
/// handed a [`Handle`], and is waited for (after the shutdown) before this
/// returns.
pub async fn run_with<F, Fut>(
    listener: TcpListener,
    config: Config,
    shutdown: CancellationToken,
    attach: F,
) -> Result<(), MetadataError>
where
    F: FnOnce(Handle) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    config.validate()?;
    let (db, loaded) = Db::open(&config.state_dir)?;
    tracing::info!(
        keys = loaded.records.len(),
        agents = loaded.agents.len(),
        state_dir = %config.state_dir.display(),
        "registry loaded"
    );
    let agent_ttl_ms = millis(config.agent_ttl);
    let mut registry = Registry::restore(
        agent_ttl_ms,
        loaded.records,
        loaded.agents,
        loaded.services,
        now_ms(),
    );
    // The services the tokens file grants are known from the start.
    let granted = config
        .server
        .auth
        .as_ref()
        .map(|a| a.services())
        .unwrap_or_default();
    let new = registry.know_services(granted.iter().map(String::as_str));
    db.write(&Batch {
        put_services: new,
        ..Batch::default()
    })?;
    if !loaded.groups.is_empty() {
        tracing::info!(
            groups = loaded.groups.len(),
            "broadcast groups loaded; members rejoin"
        );
    }
    let groups = Groups::restore(loaded.groups, now_ms());
    let http = kt_api::tls::http_builder()
        .map_err(|e| MetadataError::Client(e.to_string()))?
        .timeout(Duration::from_secs(60))
        .build()
        .map_err(|e| MetadataError::Client(e.to_string()))?;
    let signer = kt_service::capability::Signer::load_or_create(&config.state_dir, now_ms())
        .map_err(|e| MetadataError::Config(e.to_string()))?;
    let (closed_tx, closed) = oneshot::channel();
    let metrics = Arc::new(Metrics::new());
    let state: AppState = Arc::new(Inner {
        registry: Mutex::new(registry),
        leases: Mutex::new(Leases::default()),
        store_url: Mutex::new(loaded.store_url),
        broadcasts: std::sync::Mutex::new(Broadcasts::new(groups)),
        shutdown: shutdown.clone(),
        sessions: TaskTracker::new(),
        db,
        stores: kt_api::Api::new(http, "", config.server.token.credential()),
        heartbeat_interval_ms: millis(config.heartbeat_interval),
        agent_ttl_ms,
        lease_ttl_ms: millis(config.lease_ttl),
        signer,
        metrics: metrics.clone(),
        _closed: closed_tx,
    });
    // Every route declares who may call it (admin always may; see
    // kt_types::auth and kt-tests' roles table).
    use kt_service::{ADMIN, allow};
    use kt_types::auth::Role::{Agent, Store, Workload};
    let api = Router::new()
        .route(
            "/api/v1/stores",
            allow(&[Store], post(stores::register_store)),
        )
        .route(
            "/api/v1/store",
            allow(&[Workload, Agent, Store], get(stores::get_store)),
        )
        .route("/api/v1/keys", allow(&[Workload], get(keys::list_keys)))
        .route(
            "/api/v1/keys/{*key}",
            allow(&[Workload, Agent, Store], get(keys::get_key))
                .merge(allow(&[Store, Agent], put(keys::put_key)))
                .merge(allow(&[Workload, Agent], delete(keys::delete_key)))
                .merge(allow(&[Workload], post(leases::lease_key))),
        )
        .route(
            "/api/v1/tensors/grants/{*key}",
            allow(&[Agent], post(leases::tensor_grant)),
        )
        .route(
            "/api/v1/owners/{*key}",
            allow(&[Store], get(keys::key_owner)),
        )
        .route("/api/v1/leases", allow(ADMIN, get(leases::list_leases)))
        .route(
            "/api/v1/leases/{id}",
            allow(
                &[Workload],
                put(leases::renew_lease).delete(leases::release_lease),
            ),
        )
        .route(
            "/api/v1/leases/{id}/failed",
            allow(&[Workload], post(leases::lease_failed)),
        )
        .route(
            "/api/v1/agents",
            allow(&[Agent], post(agents::heartbeat)).merge(allow(ADMIN, get(agents::list_agents))),
        )
        .route(
            "/api/v1/services/{name}",
            allow(&[Workload], delete(services::teardown)),
        )
        .route(
            "/api/v1/broadcasts/join",
            allow(&[Workload], get(join_broadcast)),
        )
        .route(
            "/api/v1/broadcasts/{group}",
            allow(ADMIN, get(get_broadcast)),
        )
        .with_state(state.clone());
    // Quorums live in memory only: a restart fails the open ones.
    let quorums = Arc::new(
        Quorums::new(shutdown.clone())
            .with_metrics(metrics.clone())
            .with_limits(JoinLimits::for_server(config.server.max_in_flight)),
    );
    metrics.attach(Arc::new(gauges::RegistryGauges {
        state: Arc::downgrade(&state),
        quorums: Arc::downgrade(&quorums),
    }));
    let api = api.merge(
        Router::new()
            .route("/api/v1/status", allow(ADMIN, get(gauges::status)))
            .with_state((state.clone(), quorums.clone())),
    );
    let api = api.merge(crate::quorum::routes(
        quorums,
        Arc::new(Handle(state.clone())),
    ));
    let ready = Ready::default();
    ready.set(true);
    let auth = config.server.callers();
    // The store and agents ask here who the tokens they are shown are.
    let api = api
        .merge(kt_service::auth::review_routes(auth.clone()))
        // Bodies buffered whole (quorum joins) share one budget, however
        // many come at once.
        .layer(axum::Extension(kt_service::BodyBudget::new(BODY_BUDGET)));
    let app = kt_service::app(api, auth, metrics, ready, config.server.max_in_flight);
    let app = kt_service::trace::layer(app, "metadata");
    let sessions = state.sessions.clone();
    sessions.spawn(attach(Handle(state.clone())));
    let sweeper = tokio::spawn(sweep::sweep(state, config.sweep_interval, shutdown.clone()));
    tracing::info!(addr = %listener.local_addr()?, "metadata server listening");
    let served = kt_service::serve_tls(
        listener,
        app,
        shutdown.clone(),
        Duration::from_secs(10),
        config.server.tls.as_ref(),
    )
    .await;
    shutdown.cancel();
    let _ = sweeper.await;
    // Member sessions end on the cancel; none outlives the database.
    sessions.close();
    sessions.wait().await;
    // Connection tasks may still be dropping the state (and closing the
    // database) a moment after the server stopped: wait until it is closed,
    // so that a server started next on the same state directory can open it.
    if tokio::time::timeout(Duration::from_secs(10), closed)
        .await
        .is_err()
    {
        tracing::warn!("the state database was still in use 10 s after the server stopped");
    }
    served.map_err(MetadataError::from)
}

/// Makes the services `who` acts within known (a token limited to some
/// services names real ones); those new (to persist).
fn note_services(registry: &mut Registry, who: &Principal) -> Vec<String> {
    match (&who.services, who.scope.is_some()) {
        (Some(services), false) if who.role != Role::Admin => {
            registry.know_services(services.iter().map(String::as_str))
        }
        _ => Vec::new(),
    }
}

/// Service names follow the key grammar.
fn check_service(service: Option<&str>) -> Result<(), ApiError> {
    match service {
        Some(name) => Key::parse(name)
            .map(drop)
            .map_err(|e| ApiError::bad_request(format!("service name: {e}"))),
        None => Ok(()),
    }
}

/// Longest URL a client may register (agents, relays, `served_by`).
const MAX_URL: usize = 2048;

fn check_url(what: &str, url: &str) -> Result<(), ApiError> {
    if url.len() > MAX_URL {
        return Err(ApiError::bad_request(format!(
            "{what} is {} bytes long, more than {MAX_URL}",
            url.len()
        )));
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "{what} {url:?} is not an http(s) URL"
        )))
    }
}

/// Agent ids are pod names: 1 to 253 of `[A-Za-z0-9._-]`, and never `store`.
fn check_agent_id(id: &str) -> Result<(), ApiError> {
    match kt_types::agent_id_problem(id) {
        None => Ok(()),
        Some(why) => Err(ApiError::bad_request(why)),
    }
}
