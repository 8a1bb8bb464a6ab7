//! HTTP API of the metadata server, and the WebSocket of broadcast members.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{delete, get, post, put};
use kt_service::{ApiError, ApiJson, Metrics, Ready, Token, forbidden};
use kt_types::api::{
    AgentHeartbeat, AgentList, DeleteQuery, DeleteResponse, HeartbeatReply, KeyOwner, LeaseInfo,
    LeaseList, LeaseRequest, ListQuery, ListResponse, RegisterKey, RegisterStore, SourceFailure,
    SourceLease, StoreLocation, TeardownResponse,
};
use kt_types::auth::{Principal, Role};
use kt_types::{ErrorCode, Key, KeyPrefix, KeyRecord, Locale, STORE_HOLDER, paths};
use tokio::net::TcpListener;
use tokio::sync::{Mutex, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::broadcast::Groups;
use crate::db::{Batch, Db, DbError};
use crate::leases::Leases;
use crate::quorum::Quorums;
use crate::registry::{Eviction, Registry, SourceError};

mod broadcasts;
mod gauges;

use broadcasts::{Broadcasts, get_broadcast, join_broadcast, sweep_broadcasts};

/// Everything the server needs besides its listener.
#[derive(Debug, Clone)]
pub struct Config {
    pub state_dir: PathBuf,
    pub token: Token,
    /// Who may call this server (`--auth-file`); `None`: the token alone,
    /// as admin.
    pub auth: Option<kt_service::Auth>,
    /// Serve HTTPS with this certificate (`--tls-cert`, `--tls-key`).
    pub tls: Option<kt_service::tls::Tls>,
    /// Requests served at once; more wait.
    pub max_in_flight: usize,
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

    /// Defaults for everything but the state directory and token.
    pub fn new(state_dir: impl Into<PathBuf>, token: Token) -> Self {
        Config {
            state_dir: state_dir.into(),
            token,
            auth: None,
            tls: None,
            max_in_flight: 512,
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
        stores: kt_api::Api::new(http, "", config.token.credential()),
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
        .route("/api/v1/stores", allow(&[Store], post(register_store)))
        .route(
            "/api/v1/store",
            allow(&[Workload, Agent, Store], get(get_store)),
        )
        .route("/api/v1/keys", allow(&[Workload], get(list_keys)))
        .route(
            "/api/v1/keys/{*key}",
            allow(&[Workload, Agent, Store], get(get_key))
                .merge(allow(&[Store, Agent], put(put_key)))
                .merge(allow(&[Workload, Agent], delete(delete_key)))
                .merge(allow(&[Workload], post(lease_key))),
        )
        .route("/api/v1/owners/{*key}", allow(&[Store], get(key_owner)))
        .route("/api/v1/leases", allow(ADMIN, get(list_leases)))
        .route(
            "/api/v1/leases/{id}",
            allow(&[Workload], put(renew_lease).delete(release_lease)),
        )
        .route(
            "/api/v1/leases/{id}/failed",
            allow(&[Workload], post(lease_failed)),
        )
        .route(
            "/api/v1/agents",
            allow(&[Agent], post(heartbeat)).merge(allow(ADMIN, get(list_agents))),
        )
        .route(
            "/api/v1/services/{name}",
            allow(&[Workload], delete(teardown)),
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
    let quorums = Arc::new(Quorums::new(shutdown.clone()).with_metrics(metrics.clone()));
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
    let auth = config
        .auth
        .clone()
        .unwrap_or_else(|| config.token.clone().into());
    // The store and agents ask here who the tokens they are shown are.
    let api = api.merge(kt_service::auth::review_routes(auth.clone()));
    let app = kt_service::app(api, auth, metrics, ready, config.max_in_flight);
    let app = kt_service::trace::layer(app, "metadata");
    let sessions = state.sessions.clone();
    sessions.spawn(attach(Handle(state.clone())));
    let sweeper = tokio::spawn(sweep(state, config.sweep_interval, shutdown.clone()));
    tracing::info!(addr = %listener.local_addr()?, "metadata server listening");
    let served = kt_service::serve_tls(
        listener,
        app,
        shutdown.clone(),
        Duration::from_secs(10),
        config.tls.as_ref(),
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

async fn register_store(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<RegisterStore>,
) -> Result<StatusCode, ApiError> {
    if !(req.url.starts_with("http://") || req.url.starts_with("https://")) {
        return Err(ApiError::bad_request(format!(
            "store url {:?} is not an http(s) URL",
            req.url
        )));
    }
    s.db.set_store_url(&req.url).map_err(db_err)?;
    *s.store_url.lock().await = Some(req.url.clone());
    tracing::info!(url = %req.url, "store registered");
    Ok(StatusCode::NO_CONTENT)
}

async fn get_store(State(s): State<AppState>) -> Result<ApiJson<StoreLocation>, ApiError> {
    match s.store_url.lock().await.clone() {
        Some(url) => Ok(ApiJson(StoreLocation { url })),
        None => Err(ApiError::new(
            ErrorCode::NoStore,
            "no store server has registered with this metadata server",
        )),
    }
}

async fn put_key(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(key): Path<String>,
    ApiJson(mut reg): ApiJson<RegisterKey>,
) -> Result<ApiJson<KeyRecord>, ApiError> {
    let key = Key::parse(&key)?;
    check_registration(&reg)?;
    // The store registers what it committed; an agent what it holds.
    let own = match who.role {
        Role::Admin => true,
        Role::Store => reg.locale == Locale::Store,
        Role::Agent | Role::Pod => {
            reg.locale == Locale::Local && reg.holder.as_deref().is_some_and(|h| who.is_agent(h))
        }
        Role::Workload | Role::Metrics => false,
    };
    if !own {
        return Err(forbidden(format!(
            "a {} token may not register {key} as {:?} held by {:?}",
            who.role,
            reg.locale,
            reg.holder.as_deref().unwrap_or(STORE_HOLDER)
        )));
    }
    if !who.may_advertise(&reg.source) {
        return Err(forbidden(format!(
            "this pod's token may advertise sources on its own IP only, not {:?}",
            reg.source
        )));
    }
    let now = now_ms();
    let mut registry = s.registry.lock().await;
    let mut services = note_services(&mut registry, &who);
    // A pod (or an agent given services) registers only its services'
    // keys, and never takes over a key another service owns; the store's
    // registrations were checked at the store, when the put came.
    if who.services.is_some() && matches!(who.role, Role::Agent | Role::Pod) {
        // Naming none: the one service it writes, if one (as at the store).
        if reg.options.service.is_none() {
            reg.options.service = who.sole_service().map(str::to_owned);
        }
        let service = who.write_service(&key, reg.options.service.as_deref());
        if let Some(why) = who.refuses_write(&key, &service) {
            return Err(forbidden(why));
        }
        check_owner(&registry, &who, &key, now)?;
    }
    // A put for the service its key's first segment names (the putter's
    // own, or named explicitly) makes that service known.
    if reg.options.service.as_deref() == Some(key.service()) {
        services.extend(registry.know_services([key.service()]));
    }
    // Checked once the caller is known to be allowed (a refused caller
    // learns nothing of what its registration lacks). Integrity is anchored
    // here: a record without it could not tell a getter which manifest is
    // the published one.
    if reg.tensors.is_none() && reg.digest.is_none() {
        return Err(ApiError::bad_request(
            "a filesystem key's registration needs `digest`, the blake3 of its manifest's encoding",
        ));
    }
    // An agent registering a local key is alive, even before its first beat.
    let agent = match (reg.locale, &reg.holder) {
        (Locale::Local, Some(holder)) => registry.touch_agent(holder, &reg.source, None, now),
        _ => None,
    };
    registry
        .admits(&key, &reg, now)
        .map_err(|e| ApiError::new(ErrorCode::Conflict, e.to_string()))?;
    let record = registry.record_for(key, reg, now);
    s.db.write(&Batch {
        put_records: vec![record.clone()],
        put_agents: agent.into_iter().collect(),
        put_services: services,
        ..Batch::default()
    })
    .map_err(db_err)?;
    let replaced = registry.get_any(&record.key).cloned();
    registry.insert(record.clone());
    drop(registry);
    if let Some(old) =
        replaced.filter(|old| old.holder == STORE_HOLDER && record.holder != STORE_HOLDER)
    {
        // A `locale=local` put took the key over from the store: the store's
        // copy is no one's source any more. The store also finds such
        // orphans itself when it starts.
        let s = s.clone();
        tokio::spawn(kt_api::trace::carry(async move {
            drop_store_copy(&s, &old.source, &old.key, Some(&old.version)).await
        }));
    }
    Ok(ApiJson(record))
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

/// Refuses `who` (admin aside) a write of `key` owned by a service it does
/// not write: the one whose base path holds it, else its record's. A
/// caller always writes under its own services' base paths.
fn check_owner(registry: &Registry, who: &Principal, key: &Key, now: u64) -> Result<(), ApiError> {
    if !who.asks_owner(key) {
        return Ok(());
    }
    let owner = registry.owner(key, now);
    match who.refuses_takeover(key, owner.as_ref().map(|(o, base)| (o.as_str(), *base))) {
        Some(why) => Err(forbidden(why)),
        None => Ok(()),
    }
}

/// `GET /api/v1/owners/{key}`: which service may write `key` (the store
/// asks before it takes a put from a token limited to some services).
async fn key_owner(
    State(s): State<AppState>,
    Path(key): Path<String>,
) -> Result<ApiJson<KeyOwner>, ApiError> {
    let key = Key::parse(&key)?;
    let owner = s.registry.lock().await.owner(&key, now_ms());
    Ok(ApiJson(KeyOwner {
        base_path: owner.as_ref().is_some_and(|(_, base)| *base),
        service: owner.map(|(s, _)| s),
        key,
    }))
}

/// Deletes the store's copy of a key after another holder took the key
/// over (`version`: the one superseded), or after a key another held was
/// deleted (any version: an orphan a failed takeover left). The store keeps
/// it if its record names the store again. Logged, not retried (the store's
/// start-up pass finds what is left).
async fn drop_store_copy(s: &Inner, store_url: &str, key: &Key, version: Option<&str>) {
    let mut query = vec![("orphaned", "true")];
    query.extend(version.map(|v| ("version", v)));
    let deleted = s
        .stores
        .at(store_url)
        .delete(&paths::tree(key))
        .query(&query)
        .ok()
        .await;
    match deleted {
        Ok(()) => {
            tracing::info!(%key, version, "store copy of a key no longer the store's deleted")
        }
        Err(e) if e.code() == ErrorCode::NotFound => {}
        Err(e) => {
            tracing::warn!(%key, version, error = %e, "could not delete the store copy of a key no longer the store's")
        }
    }
}

/// A store key is held by the store; a local key by the agent named in `holder`.
fn check_registration(reg: &RegisterKey) -> Result<(), ApiError> {
    check_service(reg.options.service.as_deref())?;
    check_url("source", &reg.source)?;
    match (reg.locale, reg.holder.as_deref()) {
        (Locale::Store, None | Some(STORE_HOLDER)) => Ok(()),
        (Locale::Store, Some(h)) => Err(ApiError::bad_request(format!(
            "a locale=store key is held by the store, not by {h:?}"
        ))),
        (Locale::Local, Some(h)) => check_agent_id(h),
        (Locale::Local, None) => Err(ApiError::bad_request(
            "a locale=local key needs its holder: the id of the agent serving it",
        )),
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

async fn get_key(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(key): Path<String>,
) -> Result<ApiJson<KeyRecord>, ApiError> {
    let key = Key::parse(&key)?;
    let now = now_ms();
    let registry = s.registry.lock().await;
    // Refused first: a key the caller may not read is not said to be stale.
    if let Some(r) = registry.get_unexpired(&key, now) {
        kt_service::check_read(&who, &key, &r.service)?;
    }
    Ok(ApiJson(registry.served(&key, now)?.clone()))
}

/// `GET /api/v1/keys`: only the keys of services the caller's token reads.
async fn list_keys(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Query(q): Query<ListQuery>,
) -> Result<ApiJson<ListResponse>, ApiError> {
    let prefix = KeyPrefix::parse(&q.prefix)?;
    let visible = |r: &KeyRecord| who.reads(&r.service);
    let registry = s.registry.lock().await;
    let entries = if q.recursive {
        registry.list_below(&prefix, now_ms(), &visible)
    } else {
        registry.list(&prefix, now_ms(), &visible)
    };
    drop(registry);
    Ok(ApiJson(ListResponse {
        prefix: prefix.to_string(),
        entries,
    }))
}

async fn delete_key(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(key): Path<String>,
    Query(q): Query<DeleteQuery>,
) -> Result<ApiJson<DeleteResponse>, ApiError> {
    let key = Key::parse(&key)?;
    let now = now_ms();
    // A token that reads only some services sees no key of the others
    // here either (as in `ls`): they are neither named nor deleted.
    let visible = |r: &KeyRecord| who.reads(&r.service);
    let targets: Vec<KeyRecord> = {
        let reg = s.registry.lock().await;
        let has_children = || {
            if who.reads_all() {
                reg.has_children(&key, now)
            } else {
                reg.keys_within(&KeyPrefix::from(key.clone()), now)
                    .iter()
                    .any(|r| r.key != key && visible(r))
            }
        };
        if q.recursive {
            let mut within = reg.keys_within(&KeyPrefix::from(key.clone()), now);
            within.retain(visible);
            within
        } else {
            match reg.get_unexpired(&key, now).filter(|r| visible(r)) {
                Some(r) if q.version.as_ref().is_some_and(|v| *v != r.version) => {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!(
                            "{key} is at version {}, not {}: left as it is",
                            r.version,
                            q.version.as_deref().unwrap_or_default()
                        ),
                    ));
                }
                Some(r) => vec![r.clone()],
                None if has_children() => {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!(
                            "{key} is not a key but has keys below it; delete recursively (-r)"
                        ),
                    ));
                }
                None => return Err(ApiError::not_found(format!("key {key} not found"))),
            }
        }
    };
    if targets.is_empty() {
        return Err(ApiError::not_found(format!("nothing under {key}")));
    }
    // An agent drops only keys it holds; a workload only its services'
    // (the owner of a key under a service's base path is that service).
    {
        let mut registry = s.registry.lock().await;
        let new = note_services(&mut registry, &who);
        s.db.write(&Batch {
            put_services: new,
            ..Batch::default()
        })
        .map_err(db_err)?;
        let owner = |r: &KeyRecord| match registry.base_owner(&r.key) {
            Some(base) => base.to_owned(),
            None => r.service.clone(),
        };
        let writes = |r: &KeyRecord| who.serves(r.key.service()) || who.serves(&owner(r));
        if let Some(r) = targets.iter().find(|r| match who.role {
            Role::Admin => false,
            Role::Agent => !who.is_agent(&r.holder),
            Role::Pod => !who.is_agent(&r.holder) && !writes(r),
            _ => !writes(r),
        }) {
            return Err(forbidden(format!(
                "a {} token may not delete {} (service {:?}, held by {}): nothing was deleted",
                who.role,
                r.key,
                owner(r),
                r.holder
            )));
        }
    }
    let mut deleted = Vec::new();
    for r in targets {
        delete_one(&s, &r).await?;
        deleted.push(r.key);
    }
    Ok(ApiJson(DeleteResponse { deleted }))
}

/// Deletes a key's data at the store, then its record. A local key's record is
/// just dropped: its agent learns it from the `drop` list of its next beat.
async fn delete_one(s: &AppState, r: &KeyRecord) -> Result<(), ApiError> {
    if r.locale == Locale::Store && r.holder == STORE_HOLDER {
        // Only the version this record names: a put that published since is kept.
        let deleted = s
            .stores
            .at(&r.source)
            .delete(&paths::tree(&r.key))
            .query(&[("version", r.version.as_str())])
            .ok()
            .await;
        match deleted {
            Ok(()) => {}
            Err(e) if e.code() == ErrorCode::NotFound => {}
            Err(e) if e.code() == ErrorCode::Conflict => {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!(
                        "{} changed while it was being deleted; nothing was deleted, try again",
                        r.key
                    ),
                ));
            }
            Err(e @ kt_api::CallError::Transport { .. }) => {
                return Err(ApiError::new(
                    ErrorCode::Unavailable,
                    format!("store unreachable while deleting {}: {e}", r.key),
                ));
            }
            Err(e) => {
                return Err(ApiError::new(
                    ErrorCode::Unavailable,
                    format!("store refused to delete {}: {e}", r.key),
                ));
            }
        }
    }
    let mut registry = s.registry.lock().await;
    // A newer version registered meanwhile keeps its record.
    if registry
        .get_any(&r.key)
        .is_some_and(|cur| cur.version == r.version)
    {
        s.db.remove_record(&r.key).map_err(db_err)?;
        registry.remove(&r.key, now_ms());
        tracing::info!(key = %r.key, "key deleted");
        drop(registry);
        // A key an agent held may have left a store copy behind (a takeover
        // whose deletion failed): it goes now, unless the store holds it
        // for a record of its own again.
        if r.holder != STORE_HOLDER
            && let Some(store) = s.store_url.lock().await.clone()
        {
            let (s, key) = (s.clone(), r.key.clone());
            tokio::spawn(kt_api::trace::carry(async move {
                drop_store_copy(&s, &store, &key, None).await
            }));
        }
    }
    Ok(())
}

/// Source leases: `POST /api/v1/keys/{key}/lease` (the only POST under `/keys`).
async fn lease_key(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(path): Path<String>,
    ApiJson(req): ApiJson<LeaseRequest>,
) -> Result<ApiJson<SourceLease>, ApiError> {
    let Some(key) = path.strip_suffix("/lease") else {
        return Err(ApiError::not_found("no such route"));
    };
    let key = Key::parse(key)?;
    let now = now_ms();
    let sources = readable_sources(&s, &who, &key, &req, now).await?;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let lease = s
        .leases
        .lock()
        .await
        .grant(
            id,
            (key, who.clone()),
            &sources.candidates,
            now,
            s.lease_ttl_ms,
        )
        .ok_or_else(|| ApiError::internal("a key with sources yielded no lease"))?;
    let getter = req.getter.as_deref().or(who.name.as_deref());
    let capability = s.capability_for(&lease.key, &lease.source, getter, now);
    Ok(ApiJson(SourceLease {
        lease: lease.id,
        source: lease.source,
        ttl_ms: s.lease_ttl_ms,
        record: sources.record,
        capability,
    }))
}

impl Inner {
    /// What a getter shows `source` to read `key` there: a capability for
    /// an agent; nothing for the store, which is shown the getter's token.
    fn capability_for(
        &self,
        key: &Key,
        source: &kt_types::Source,
        getter: Option<&str>,
        now: u64,
    ) -> Option<String> {
        (source.id != STORE_HOLDER).then(|| {
            let scope = kt_types::auth::Scope {
                key: key.clone(),
                version: source.version.clone(),
            };
            self.signer
                .mint(scope, &source.id, getter.unwrap_or("workload"), now)
        })
    }
}

/// The live sources of `key` for `who`, refused first (before anything of
/// its sources is told) when its token may not read the key's service.
async fn readable_sources(
    s: &AppState,
    who: &Principal,
    key: &Key,
    req: &LeaseRequest,
    now: u64,
) -> Result<crate::registry::Sources, ApiError> {
    let store_registered = s.store_url.lock().await.is_some();
    let registry = s.registry.lock().await;
    if let Some(r) = registry.get_unexpired(key, now) {
        kt_service::check_read(who, key, &r.service)?;
    }
    Ok(registry.sources(key, req, store_registered, now)?)
}

fn unknown_lease(id: &str) -> ApiError {
    ApiError::not_found(format!("lease {id} not found (released or expired)"))
}

async fn renew_lease(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<ApiJson<LeaseInfo>, ApiError> {
    let now = now_ms();
    let lease = s.leases.lock().await.renew(&id, now, s.lease_ttl_ms);
    lease
        .map(|l| ApiJson(l.info(now)))
        .ok_or_else(|| unknown_lease(&id))
}

async fn release_lease(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let lease = s.leases.lock().await.release(&id, now_ms());
    lease
        .map(|_| StatusCode::NO_CONTENT)
        .ok_or_else(|| unknown_lease(&id))
}

/// Ends the lease; a peer that failed a getter stops being offered for that
/// key (its next heartbeat adds it back if it still serves the version). An
/// origin is only released: the getter excludes it from its next request.
async fn lease_failed(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    ApiJson(failure): ApiJson<SourceFailure>,
) -> Result<StatusCode, ApiError> {
    let released = {
        let mut leases = s.leases.lock().await;
        match leases.get(&id, now_ms()) {
            Some(l) if l.getter != who && who.role != Role::Admin => {
                return Err(forbidden(format!(
                    "lease {id} is another getter's: only the getter it was granted to reports its source"
                )));
            }
            Some(_) => leases.release(&id, now_ms()),
            None => None,
        }
    };
    // A lease this server no longer knows (it restarted, or the lease
    // expired) is reported by key and source instead; nobody can tell
    // whose it was, so it drops no peer (an admin's report aside).
    let (key, source, url, known) = match (released, failure.key, failure.source) {
        (Some(l), _, _) => (l.key, l.source.id, l.source.url, true),
        (None, Some(key), Some(source)) => {
            check_agent_or_store(&source)?;
            (key, source, String::new(), who.role == Role::Admin)
        }
        (None, _, _) => return Err(unknown_lease(&id)),
    };
    // The reason is the getter's text: bounded, and logged escaped.
    let reason: String = failure.reason.chars().take(MAX_REASON).collect();
    tracing::warn!(
        %key,
        %source,
        %url,
        reason = ?reason,
        transient = failure.transient,
        "a source failed a getter"
    );
    if failure.transient || !known {
        return Ok(StatusCode::NO_CONTENT);
    }
    let mut registry = s.registry.lock().await;
    if let Some(record) = registry.remove_peer(&key, &source) {
        s.db.put_record(&record).map_err(db_err)?;
        tracing::info!(%key, peer = %source, "peer no longer offered");
    }
    Ok(StatusCode::NO_CONTENT)
}

/// The most of a failure report's reason that is logged, in characters.
const MAX_REASON: usize = 512;

/// A source id in a failure report: the store or an agent id.
fn check_agent_or_store(id: &str) -> Result<(), ApiError> {
    if id == kt_types::STORE_HOLDER {
        return Ok(());
    }
    check_agent_id(id)
}

async fn list_leases(State(s): State<AppState>) -> ApiJson<LeaseList> {
    let leases = s.leases.lock().await.list(now_ms());
    ApiJson(LeaseList { leases })
}

async fn heartbeat(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiJson(hb): ApiJson<AgentHeartbeat>,
) -> Result<ApiJson<HeartbeatReply>, ApiError> {
    check_agent_id(&hb.id)?;
    if !who.is_agent(&hb.id) {
        return Err(forbidden(format!(
            "this agent token is {:?}'s, not {:?}'s",
            who.name.as_deref().unwrap_or_default(),
            hb.id
        )));
    }
    check_url("agent url", &hb.url)?;
    if !who.may_advertise(&hb.url) {
        return Err(forbidden(format!(
            "this pod's token may announce its agent on its own IP only, not {:?}",
            hb.url
        )));
    }
    check_service(hb.service.as_deref())?;
    let id = hb.id.clone();
    let mut registry = s.registry.lock().await;
    // An agent is a peer only of what its token may read: a copy of
    // another service's key it claims to serve is dropped.
    let mut services = note_services(&mut registry, &who);
    services.extend(registry.know_services(hb.service.as_deref()));
    let beat = registry.heartbeat_reading(hb, now_ms(), |key, service| {
        who.refuses_read(key, service).is_none()
    });
    if let Some(a) = &beat.agent {
        tracing::info!(agent = %a.id, url = %a.url, service = ?a.service, "agent announced");
    }
    let changed = beat.changed.len();
    s.db.write(&Batch {
        put_records: beat.changed,
        put_agents: beat.agent.into_iter().collect(),
        put_services: services,
        ..Batch::default()
    })
    .map_err(db_err)?;
    drop(registry);
    if changed > 0 || !beat.drop.is_empty() {
        tracing::debug!(agent = %id, changed, dropped = beat.drop.len(), "agent reconciled");
    }
    Ok(ApiJson(HeartbeatReply {
        interval_ms: s.heartbeat_interval_ms,
        ttl_ms: s.agent_ttl_ms,
        drop: beat.drop,
        capability_keys: s.signer.public_keys(),
    }))
}

async fn list_agents(State(s): State<AppState>) -> ApiJson<AgentList> {
    let agents = s.registry.lock().await.agents(now_ms());
    ApiJson(AgentList { agents })
}

/// Removes agents and their peer entries, committing the change.
fn commit_eviction(s: &Inner, e: &Eviction, why: &str) -> Result<(), DbError> {
    for id in &e.agents {
        tracing::info!(agent = %id, why, "agent evicted");
    }
    s.db.write(&Batch {
        put_records: e.changed.clone(),
        remove_agents: e.agents.clone(),
        ..Batch::default()
    })
}

/// `DELETE /api/v1/services/{name}`: evicts the service's agents and deletes
/// its `resource` keys, its base path but for `lifespan=cluster` keys, and
/// its zero-copy data ([`Registry::teardown_plan`]). Run again after a
/// partial failure: it is idempotent.
async fn teardown(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    Path(name): Path<String>,
) -> Result<ApiJson<TeardownResponse>, ApiError> {
    if !who.serves(&name) {
        return Err(forbidden(format!(
            "this token may not tear down service {name:?} (not one of its services)"
        )));
    }
    teardown_service(&s, &name).await.map(ApiJson)
}

/// Evicts a service's agents for good and deletes what its lifespan rule
/// ties to it ([`Registry::teardown_plan`]). The name is a service's from
/// then on (its base path stays its own).
async fn teardown_service(s: &AppState, name: &str) -> Result<TeardownResponse, ApiError> {
    check_service(Some(name))?;
    // Agents first, so none is handed out as a source while keys go.
    let (targets, evicted) = {
        let mut registry = s.registry.lock().await;
        let (targets, agents) = registry.teardown_plan(name);
        let new = registry.know_services([name]);
        s.db.write(&Batch {
            put_services: new,
            ..Batch::default()
        })
        .map_err(db_err)?;
        let eviction = registry.retire(&agents);
        commit_eviction(s, &eviction, "service torn down").map_err(db_err)?;
        (targets, eviction.agents)
    };
    let mut deleted = Vec::new();
    let mut failed = Vec::new();
    for r in targets {
        match delete_one(s, &r).await {
            Ok(()) => deleted.push(r.key),
            Err(e) => failed.push(e),
        }
    }
    if let Some(first) = failed.first() {
        return Err(ApiError::new(
            first.code,
            format!(
                "teardown of service {name} incomplete: {} key(s) deleted, {} not ({}); run it again",
                deleted.len(),
                failed.len(),
                first.message
            ),
        ));
    }
    tracing::info!(service = %name, keys = deleted.len(), agents = evicted.len(), "service torn down");
    Ok(TeardownResponse { deleted, evicted })
}

/// Every `every`: drops expired leases, evicts silent agents, sweeps
/// broadcast groups, deletes expired keys.
async fn sweep(s: AppState, every: Duration, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = now_ms();
        s.leases.lock().await.expire(now);
        {
            let mut registry = s.registry.lock().await;
            registry.forget_deletions(now, 0);
            let eviction = registry.evict_stale(now);
            if let Err(e) = commit_eviction(&s, &eviction, "no heartbeat within the agent TTL") {
                tracing::warn!(error = %e, "could not persist an eviction; it is redone at start");
            }
        }
        sweep_broadcasts(&s, now);
        let expired = s.registry.lock().await.expired(now);
        for r in expired {
            if let Err(e) = delete_one(&s, &r).await {
                tracing::warn!(key = %r.key, error = %e, "could not delete expired key; will retry");
            }
        }
    }
}
