//! HTTP API of the metadata server, and the WebSocket of broadcast members.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use kt_service::{ApiError, ApiJson, Metrics, Ready, Token};
use kt_types::api::{
    AgentHeartbeat, AgentList, DeleteQuery, DeleteResponse, HeartbeatReply, LeaseInfo, LeaseList,
    LeaseRequest, ListQuery, ListResponse, RegisterKey, RegisterStore, SourceFailure, SourceLease,
    StoreLocation, TeardownResponse,
};
use kt_types::broadcast::{GetterMessage, GroupInfo, GroupMessage, JoinRequest, Parent};
use kt_types::{ErrorCode, Key, KeyPrefix, KeyRecord, Locale, STORE_HOLDER};
use tokio::net::TcpListener;
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::broadcast::{Events, Groups, JoinError, Joined};
use crate::db::{Batch, Db, DbError};
use crate::leases::Leases;
use crate::quorum::Quorums;
use crate::registry::{Eviction, Registry, SourceError};

/// Everything the server needs besides its listener.
#[derive(Debug, Clone)]
pub struct Config {
    pub state_dir: PathBuf,
    pub token: Token,
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
    http: reqwest::Client,
    token: Token,
    heartbeat_interval_ms: u64,
    agent_ttl_ms: u64,
    lease_ttl_ms: u64,
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
            SourceError::UnknownKey(_) => ErrorCode::NotFound,
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
    let registry = Registry::restore(agent_ttl_ms, loaded.records, loaded.agents, now_ms());
    if !loaded.groups.is_empty() {
        tracing::info!(
            groups = loaded.groups.len(),
            "broadcast groups loaded; members rejoin"
        );
    }
    let groups = Groups::restore(loaded.groups, now_ms());
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .map_err(|e| MetadataError::Client(e.to_string()))?;
    let (closed_tx, closed) = oneshot::channel();
    let state: AppState = Arc::new(Inner {
        registry: Mutex::new(registry),
        leases: Mutex::new(Leases::default()),
        store_url: Mutex::new(loaded.store_url),
        broadcasts: std::sync::Mutex::new(Broadcasts {
            groups,
            senders: HashMap::new(),
        }),
        shutdown: shutdown.clone(),
        sessions: TaskTracker::new(),
        db,
        http,
        token: config.token.clone(),
        heartbeat_interval_ms: millis(config.heartbeat_interval),
        agent_ttl_ms,
        lease_ttl_ms: millis(config.lease_ttl),
        _closed: closed_tx,
    });
    let api = Router::new()
        .route("/api/v1/stores", post(register_store))
        .route("/api/v1/store", get(get_store))
        .route("/api/v1/keys", get(list_keys))
        .route(
            "/api/v1/keys/{*key}",
            get(get_key).put(put_key).delete(delete_key).post(lease_key),
        )
        .route("/api/v1/leases", get(list_leases))
        .route(
            "/api/v1/leases/{id}",
            put(renew_lease).delete(release_lease),
        )
        .route("/api/v1/leases/{id}/failed", post(lease_failed))
        .route("/api/v1/agents", post(heartbeat).get(list_agents))
        .route("/api/v1/services/{name}", delete(teardown))
        .route("/api/v1/broadcasts/join", get(join_broadcast))
        .route("/api/v1/broadcasts/{group}", get(get_broadcast))
        .with_state(state.clone());
    let metrics = Arc::new(Metrics::new());
    // Quorums live in memory only: a restart fails the open ones.
    let quorums = Quorums::new(shutdown.clone()).with_metrics(metrics.clone());
    let api = api.merge(crate::quorum::routes(Arc::new(quorums)));
    let ready = Ready::default();
    ready.set(true);
    let app = kt_service::app(
        api,
        config.token.clone(),
        metrics,
        ready,
        config.max_in_flight,
    );
    let sessions = state.sessions.clone();
    sessions.spawn(attach(Handle(state.clone())));
    let sweeper = tokio::spawn(sweep(state, config.sweep_interval, shutdown.clone()));
    tracing::info!(addr = %listener.local_addr()?, "metadata server listening");
    let served = kt_service::serve(listener, app, shutdown.clone(), Duration::from_secs(10)).await;
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
    Path(key): Path<String>,
    ApiJson(reg): ApiJson<RegisterKey>,
) -> Result<ApiJson<KeyRecord>, ApiError> {
    let key = Key::parse(&key)?;
    check_registration(&reg)?;
    let now = now_ms();
    let mut registry = s.registry.lock().await;
    // An agent registering a local key is alive, even before its first beat.
    let agent = match (reg.locale, &reg.holder) {
        (Locale::Local, Some(holder)) => registry.touch_agent(holder, &reg.source, None, now),
        _ => None,
    };
    let record = registry.record_for(key, reg, now);
    s.db.write(&Batch {
        put_records: vec![record.clone()],
        put_agents: agent.into_iter().collect(),
        ..Batch::default()
    })
    .map_err(db_err)?;
    registry.insert(record.clone());
    Ok(ApiJson(record))
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
    let valid = !id.is_empty()
        && id.len() <= 253
        && id != STORE_HOLDER
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if valid {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "agent id {id:?} is not a pod name (1 to 253 letters, digits, '.', '_' or '-'; not {STORE_HOLDER:?})"
        )))
    }
}

async fn get_key(
    State(s): State<AppState>,
    Path(key): Path<String>,
) -> Result<ApiJson<KeyRecord>, ApiError> {
    let key = Key::parse(&key)?;
    s.registry
        .lock()
        .await
        .get(&key, now_ms())
        .cloned()
        .map(ApiJson)
        .ok_or_else(|| ApiError::not_found(format!("key {key} not found")))
}

async fn list_keys(
    State(s): State<AppState>,
    Query(q): Query<ListQuery>,
) -> Result<ApiJson<ListResponse>, ApiError> {
    let prefix = KeyPrefix::parse(&q.prefix)?;
    let entries = s.registry.lock().await.list(&prefix, now_ms());
    Ok(ApiJson(ListResponse {
        prefix: prefix.to_string(),
        entries,
    }))
}

async fn delete_key(
    State(s): State<AppState>,
    Path(key): Path<String>,
    Query(q): Query<DeleteQuery>,
) -> Result<ApiJson<DeleteResponse>, ApiError> {
    let key = Key::parse(&key)?;
    let now = now_ms();
    let targets: Vec<KeyRecord> = {
        let reg = s.registry.lock().await;
        if q.recursive {
            reg.keys_within(&KeyPrefix::from(key.clone()), now)
        } else {
            match reg.get(&key, now) {
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
                None if reg.has_children(&key, now) => {
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
    let mut deleted = Vec::new();
    for r in targets {
        delete_one(&s, &r).await?;
        deleted.push(r.key);
    }
    Ok(ApiJson(DeleteResponse { deleted }))
}

/// Deletes a key's data at the store, then its record. A local key's record is
/// just dropped: its agent learns it from the `drop` list of its next beat.
async fn delete_one(s: &Inner, r: &KeyRecord) -> Result<(), ApiError> {
    if r.locale == Locale::Store && r.holder == STORE_HOLDER {
        // Only the version this record names: a put that published since is kept.
        let url = format!("{}/api/v1/trees/{}", r.source.trim_end_matches('/'), r.key);
        let resp = s
            .http
            .delete(&url)
            .query(&[("version", r.version.as_str())])
            .bearer_auth(s.token.expose())
            .send()
            .await
            .map_err(|e| {
                ApiError::new(
                    ErrorCode::Unavailable,
                    format!("store unreachable while deleting {}: {e}", r.key),
                )
            })?;
        let status = resp.status();
        if status == reqwest::StatusCode::CONFLICT {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "{} changed while it was being deleted; nothing was deleted, try again",
                    r.key
                ),
            ));
        }
        if !(status.is_success() || status == reqwest::StatusCode::NOT_FOUND) {
            let body = resp.text().await.unwrap_or_default();
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                format!("store refused to delete {}: {status} {body}", r.key),
            ));
        }
    }
    let mut registry = s.registry.lock().await;
    // A newer version registered meanwhile keeps its record.
    if registry
        .get_any(&r.key)
        .is_some_and(|cur| cur.version == r.version)
    {
        s.db.remove_record(&r.key).map_err(db_err)?;
        registry.remove(&r.key);
        tracing::info!(key = %r.key, "key deleted");
    }
    Ok(())
}

/// Source leases: `POST /api/v1/keys/{key}/lease` (the only POST under `/keys`).
async fn lease_key(
    State(s): State<AppState>,
    Path(path): Path<String>,
    ApiJson(req): ApiJson<LeaseRequest>,
) -> Result<ApiJson<SourceLease>, ApiError> {
    let Some(key) = path.strip_suffix("/lease") else {
        return Err(ApiError::not_found("no such route"));
    };
    let key = Key::parse(key)?;
    let now = now_ms();
    let store_registered = s.store_url.lock().await.is_some();
    let sources = s
        .registry
        .lock()
        .await
        .sources(&key, &req, store_registered, now)?;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let lease = s
        .leases
        .lock()
        .await
        .grant(id, key, &sources.candidates, now, s.lease_ttl_ms)
        .ok_or_else(|| ApiError::internal("a key with sources yielded no lease"))?;
    Ok(ApiJson(SourceLease {
        lease: lease.id,
        source: lease.source,
        ttl_ms: s.lease_ttl_ms,
        record: sources.record,
    }))
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
    Path(id): Path<String>,
    ApiJson(failure): ApiJson<SourceFailure>,
) -> Result<StatusCode, ApiError> {
    let lease = s
        .leases
        .lock()
        .await
        .release(&id, now_ms())
        .ok_or_else(|| unknown_lease(&id))?;
    tracing::warn!(
        key = %lease.key,
        source = %lease.source.id,
        url = %lease.source.url,
        reason = %failure.reason,
        "a source failed a getter"
    );
    let mut registry = s.registry.lock().await;
    if let Some(record) = registry.remove_peer(&lease.key, &lease.source.id) {
        s.db.put_record(&record).map_err(db_err)?;
        tracing::info!(key = %lease.key, peer = %lease.source.id, "peer no longer offered");
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn list_leases(State(s): State<AppState>) -> ApiJson<LeaseList> {
    let leases = s.leases.lock().await.list(now_ms());
    ApiJson(LeaseList { leases })
}

async fn heartbeat(
    State(s): State<AppState>,
    ApiJson(hb): ApiJson<AgentHeartbeat>,
) -> Result<ApiJson<HeartbeatReply>, ApiError> {
    check_agent_id(&hb.id)?;
    check_url("agent url", &hb.url)?;
    check_service(hb.service.as_deref())?;
    let id = hb.id.clone();
    let mut registry = s.registry.lock().await;
    let beat = registry.heartbeat(hb, now_ms());
    if let Some(a) = &beat.agent {
        tracing::info!(agent = %a.id, url = %a.url, service = ?a.service, "agent announced");
    }
    let changed = beat.changed.len();
    s.db.write(&Batch {
        put_records: beat.changed,
        put_agents: beat.agent.into_iter().collect(),
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
/// its `resource` keys. Run again after a partial failure: it is idempotent.
async fn teardown(
    State(s): State<AppState>,
    Path(name): Path<String>,
) -> Result<ApiJson<TeardownResponse>, ApiError> {
    teardown_service(&s, &name).await.map(ApiJson)
}

/// Evicts a service's agents for good and deletes its `resource` keys.
async fn teardown_service(s: &Inner, name: &str) -> Result<TeardownResponse, ApiError> {
    // Agents first, so none is handed out as a source while keys go.
    let (targets, evicted) = {
        let mut registry = s.registry.lock().await;
        let (targets, agents) = registry.teardown_plan(name);
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

// Broadcast groups: one WebSocket per member.

/// How long a new connection has to send its `Join`.
const JOIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest message (and frame) a member may send.
const MAX_MEMBER_MESSAGE: usize = 64 << 10;
/// Read buffer of a member's connection.
const MEMBER_BUFFER: usize = 4 << 10;
/// How often a member's connection is pinged.
const PING_INTERVAL: Duration = Duration::from_secs(15);
/// A member connection silent this long (not even a pong) is closed.
const MEMBER_SILENCE: Duration = Duration::from_secs(45);

/// A member's queue of messages, held by the session of its connection.
type MemberQueue = (u64, mpsc::UnboundedSender<GroupMessage>);

/// The broadcast groups and, per connected member, where its messages go.
#[derive(Debug)]
struct Broadcasts {
    groups: Groups,
    /// By group, then rank.
    senders: HashMap<String, HashMap<u32, MemberQueue>>,
}

impl Broadcasts {
    /// Queues `events` to members of `group`; a member with no connection
    /// here has left and needs none of them.
    fn dispatch(&self, group: &str, events: Events) {
        let senders = self.senders.get(group);
        for (rank, msg) in events {
            match &msg {
                GroupMessage::Parent { parent } => tracing::info!(
                    group,
                    rank,
                    parent = parent.rank,
                    url = %parent.url,
                    "broadcast member moved to another parent"
                ),
                GroupMessage::Release => tracing::debug!(group, rank, "broadcast member released"),
                GroupMessage::Error { code, message } => tracing::info!(
                    group,
                    rank,
                    code = %code,
                    message,
                    "broadcast member cannot go on"
                ),
                GroupMessage::Assigned { .. } => {}
            }
            if let Some((_, tx)) = senders.and_then(|ranks| ranks.get(&rank)) {
                // A closed queue belongs to a connection that is ending.
                let _ = tx.send(msg);
            }
        }
    }
}

fn lock_broadcasts(s: &Inner) -> std::sync::MutexGuard<'_, Broadcasts> {
    s.broadcasts.lock().unwrap_or_else(PoisonError::into_inner)
}

impl From<JoinError> for ApiError {
    fn from(e: JoinError) -> Self {
        ApiError::new(e.code(), e.to_string())
    }
}

/// `GET /api/v1/broadcasts/join`: the WebSocket of one broadcast member.
async fn join_broadcast(
    State(s): State<AppState>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    match ws {
        Ok(ws) => ws
            // Small messages on many connections: small buffers (the
            // defaults, 128 KiB each, would cost GiBs for 10,000 members).
            .read_buffer_size(MEMBER_BUFFER)
            .write_buffer_size(0)
            .max_message_size(MAX_MEMBER_MESSAGE)
            .max_frame_size(MAX_MEMBER_MESSAGE)
            .on_upgrade(move |socket| {
                let sessions = s.sessions.clone();
                sessions.track_future(member_session(s, socket))
            }),
        Err(r) => ApiError::bad_request(format!(
            "broadcast members join over a WebSocket: {}",
            r.body_text()
        ))
        .into_response(),
    }
}

/// `GET /api/v1/broadcasts/{group}`: the tree as it stands.
async fn get_broadcast(
    State(s): State<AppState>,
    Path(group): Path<String>,
) -> Result<ApiJson<GroupInfo>, ApiError> {
    let b = lock_broadcasts(&s);
    match b.groups.info(&group, now_ms()) {
        Some(info) => Ok(ApiJson(info)),
        None if b.groups.has_ended(&group) => Err(ApiError::not_found(format!(
            "broadcast group {group:?} has ended"
        ))),
        None => Err(ApiError::not_found(format!(
            "broadcast group {group:?} is unknown"
        ))),
    }
}

/// The membership a connection holds.
#[derive(Debug)]
struct Membership {
    group: String,
    rank: u32,
    session: u64,
}

/// Why a member's session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SessionEnd {
    /// The getter closed the connection, or it broke.
    Closed,
    /// The getter was sent an error.
    Refused,
    /// The server is stopping.
    ShuttingDown,
    /// Nothing heard for [`MEMBER_SILENCE`].
    Silent,
}

/// One member's connection: its `Join`, then messages out and reports in
/// until it closes, fails, or the server stops.
async fn member_session(s: AppState, mut socket: WebSocket) {
    if s.shutdown.is_cancelled() {
        return;
    }
    let req = match first_join(&mut socket).await {
        Ok(req) => req,
        Err(e) => return refuse(&mut socket, e).await,
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let member = match admit(&s, &req, tx).await {
        Ok(m) => m,
        Err(e) => {
            tracing::debug!(key = %req.key, group = ?req.group, error = %e, "broadcast join refused");
            return refuse(&mut socket, e).await;
        }
    };
    let end = serve_member(&s, &mut socket, &member, &mut rx).await;
    leave(&s, &member);
    tracing::debug!(group = %member.group, rank = member.rank, ?end, "broadcast member left");
    if end != SessionEnd::Closed {
        let code = match end {
            SessionEnd::ShuttingDown => close_code::AWAY,
            _ => close_code::NORMAL,
        };
        let _ = socket
            .send(Message::Close(Some(CloseFrame {
                code,
                reason: "".into(),
            })))
            .await;
    }
}

/// Reads the connection's first message, which must be a `Join`.
async fn first_join(socket: &mut WebSocket) -> Result<JoinRequest, ApiError> {
    let text = tokio::time::timeout(JOIN_TIMEOUT, async {
        loop {
            match socket.recv().await {
                Some(Ok(Message::Text(text))) => return Ok(text),
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Binary(_))) => {
                    return Err(ApiError::bad_request(
                        "broadcast messages are JSON text frames",
                    ));
                }
                Some(Ok(Message::Close(_))) | None => {
                    return Err(ApiError::bad_request("closed before joining"));
                }
                Some(Err(e)) => return Err(ApiError::bad_request(format!("connection: {e}"))),
            }
        }
    })
    .await
    .map_err(|_| {
        ApiError::bad_request(format!(
            "no join within {} s of connecting",
            JOIN_TIMEOUT.as_secs()
        ))
    })??;
    match serde_json::from_str::<GetterMessage>(&text) {
        Ok(GetterMessage::Join(req)) => Ok(req),
        Ok(_) => Err(ApiError::bad_request(
            "the first message on a broadcast connection must be a join",
        )),
        Err(e) => Err(ApiError::bad_request(format!(
            "invalid broadcast message: {e}"
        ))),
    }
}

/// Sends `e` as an error message, then closes.
async fn refuse(socket: &mut WebSocket, e: ApiError) {
    let msg = GroupMessage::Error {
        code: e.code,
        message: e.message,
    };
    if send_message(socket, &msg).await.is_ok() {
        let _ = socket
            .send(Message::Close(Some(CloseFrame {
                code: close_code::NORMAL,
                reason: "".into(),
            })))
            .await;
    }
}

async fn send_message(socket: &mut WebSocket, msg: &GroupMessage) -> Result<(), axum::Error> {
    let text = serde_json::to_string(msg).map_err(axum::Error::new)?;
    socket.send(Message::Text(text.into())).await
}

/// Admits a getter: resolves the key's origin and version, joins it to its
/// group (committing the group's record first when it changed), queues its
/// `Assigned` and registers its queue. A reservation of ranks ahead is
/// committed in the background.
async fn admit(
    s: &AppState,
    req: &JoinRequest,
    tx: mpsc::UnboundedSender<GroupMessage>,
) -> Result<Membership, ApiError> {
    check_url("relay_url", &req.relay_url)?;
    if let Some(getter) = &req.getter {
        check_agent_id(getter)?;
    }
    let now = now_ms();
    let store_registered = s.store_url.lock().await.is_some();
    let lease_req = LeaseRequest {
        exclude: Vec::new(),
        getter: req.getter.clone(),
    };
    let sources = s
        .registry
        .lock()
        .await
        .sources(&req.key, &lease_req, store_registered, now)?;
    // Rank 0: the origin, or the first live peer when the origin is gone.
    let origin = sources
        .candidates
        .iter()
        .find(|c| c.origin)
        .or_else(|| sources.candidates.first())
        .map(|c| Parent {
            rank: 0,
            url: c.source.url.clone(),
            id: c.source.id.clone(),
        })
        .ok_or_else(|| ApiError::internal("a key with sources yielded none"))?;

    let mut guard = lock_broadcasts(s);
    let b = &mut *guard;
    let mut joined: Joined =
        b.groups
            .join(req, origin, &sources.record.version, now, &mut || {
                uuid::Uuid::new_v4().as_u64_pair().0
            })?;
    if let Some(record) = &joined.persist
        && let Err(e) = s.db.write(&Batch {
            put_groups: vec![record.clone()],
            ..Batch::default()
        })
    {
        let events = b.groups.undo_join(&joined, now);
        b.dispatch(&joined.group, events);
        return Err(db_err(e));
    }
    if joined.created {
        tracing::info!(group = %joined.group, key = %req.key, version = %joined.version, fanout = joined.fanout, "broadcast group started");
    }
    tracing::debug!(
        group = %joined.group,
        rank = joined.rank,
        parent = joined.parent.rank,
        rejoin = joined.rejoined,
        getter = ?req.getter,
        "broadcast member joined"
    );
    // Queued first, so it precedes every message the member gets.
    let _ = tx.send(joined.assigned());
    // A rejoin on a new connection drops the old one's queue, which ends it.
    b.senders
        .entry(joined.group.clone())
        .or_default()
        .insert(joined.rank, (joined.session, tx));
    let events = std::mem::take(&mut joined.events);
    b.dispatch(&joined.group, events);
    drop(guard);
    if let Some(record) = joined.reserve_ahead.take() {
        let s = s.clone();
        // Tracked: the database is not used after `run` returns.
        s.sessions.clone().spawn_blocking(move || {
            let written = s.db.write(&Batch {
                put_groups: vec![record.clone()],
                ..Batch::default()
            });
            let mut b = lock_broadcasts(&s);
            match written {
                Ok(()) => b.groups.reservation_committed(&record.id, record.reserved),
                Err(e) => {
                    tracing::warn!(group = %record.id, error = %e, "could not reserve broadcast ranks ahead; retried");
                    b.groups.reservation_failed(&record.id);
                }
            }
        });
    }
    Ok(Membership {
        group: joined.group,
        rank: joined.rank,
        session: joined.session,
    })
}

/// Forwards the member's messages and handles its reports until the session ends.
async fn serve_member(
    s: &Inner,
    socket: &mut WebSocket,
    m: &Membership,
    rx: &mut mpsc::UnboundedReceiver<GroupMessage>,
) -> SessionEnd {
    let start = tokio::time::Instant::now() + PING_INTERVAL;
    let mut ping = tokio::time::interval_at(start, PING_INTERVAL);
    let mut heard = Instant::now();
    loop {
        tokio::select! {
            _ = s.shutdown.cancelled() => return SessionEnd::ShuttingDown,
            msg = rx.recv() => {
                let Some(msg) = msg else {
                    let e = ApiError::new(ErrorCode::Conflict, format!(
                        "rank {} of broadcast group {:?} rejoined on another connection",
                        m.rank, m.group
                    ));
                    refuse(socket, e).await;
                    return SessionEnd::Refused;
                };
                let last = matches!(msg, GroupMessage::Error { .. });
                if send_message(socket, &msg).await.is_err() {
                    return SessionEnd::Closed;
                }
                if last {
                    return SessionEnd::Refused;
                }
            }
            frame = socket.recv() => {
                heard = Instant::now();
                let report = match frame {
                    Some(Ok(Message::Text(text))) => on_report(s, m, &text),
                    Some(Ok(Message::Binary(_))) => Err(ApiError::bad_request(
                        "broadcast messages are JSON text frames",
                    )),
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => Ok(()),
                    Some(Ok(Message::Close(_))) | None => return SessionEnd::Closed,
                    Some(Err(e)) => {
                        tracing::debug!(group = %m.group, rank = m.rank, error = %e, "broadcast connection failed");
                        return SessionEnd::Closed;
                    }
                };
                if let Err(e) = report {
                    let msg = GroupMessage::Error { code: e.code, message: e.message };
                    let _ = send_message(socket, &msg).await;
                    return SessionEnd::Refused;
                }
            }
            _ = ping.tick() => {
                if heard.elapsed() >= MEMBER_SILENCE {
                    tracing::info!(group = %m.group, rank = m.rank, "broadcast member silent; closing");
                    return SessionEnd::Silent;
                }
                if socket.send(Message::Ping(axum::body::Bytes::new())).await.is_err() {
                    return SessionEnd::Closed;
                }
            }
        }
    }
}

/// A report of the member: `Done` or `ParentFailed`.
fn on_report(s: &Inner, m: &Membership, text: &str) -> Result<(), ApiError> {
    let msg = serde_json::from_str::<GetterMessage>(text)
        .map_err(|e| ApiError::bad_request(format!("invalid broadcast message: {e}")))?;
    let now = now_ms();
    // Computed and queued under one lock, so that members get messages in
    // the order the state changed.
    let mut b = lock_broadcasts(s);
    let events = match msg {
        GetterMessage::Done { served_by } => {
            if let Some(url) = &served_by {
                check_url("served_by", url)?;
            }
            tracing::debug!(group = %m.group, rank = m.rank, ?served_by, "broadcast member done");
            b.groups.done(&m.group, m.rank, m.session, served_by, now)
        }
        GetterMessage::ParentFailed { parent, reason } => {
            tracing::info!(group = %m.group, rank = m.rank, parent, %reason, "a broadcast parent failed a member");
            b.groups
                .parent_failed(&m.group, m.rank, m.session, parent, now)
        }
        GetterMessage::Join(_) => {
            return Err(ApiError::bad_request(
                "this connection already joined; one join per connection",
            ));
        }
    };
    b.dispatch(&m.group, events);
    Ok(())
}

/// The member's connection ended: it leaves (unless a rejoin took its place).
fn leave(s: &Inner, m: &Membership) {
    let mut guard = lock_broadcasts(s);
    let b = &mut *guard;
    if let Some(ranks) = b.senders.get_mut(&m.group) {
        if ranks
            .get(&m.rank)
            .is_some_and(|(session, _)| *session == m.session)
        {
            ranks.remove(&m.rank);
        }
        if ranks.is_empty() {
            b.senders.remove(&m.group);
        }
    }
    if s.shutdown.is_cancelled() {
        // Every member leaves with the server; they rejoin the next one.
        return;
    }
    let events = b.groups.disconnected(&m.group, m.rank, m.session, now_ms());
    b.dispatch(&m.group, events);
}

/// Releases, drops ended groups and forgets their records.
fn sweep_broadcasts(s: &Inner, now: u64) {
    let forget = {
        let mut guard = lock_broadcasts(s);
        let b = &mut *guard;
        let swept = b.groups.sweep(now);
        for (group, events) in swept.events {
            b.dispatch(&group, events);
        }
        for id in &swept.dropped {
            b.senders.remove(id);
            tracing::debug!(group = %id, "broadcast group ended");
        }
        swept.forget
    };
    if forget.is_empty() {
        return;
    }
    let batch = Batch {
        remove_groups: forget,
        ..Batch::default()
    };
    if let Err(e) = s.db.write(&batch) {
        tracing::warn!(error = %e, "could not forget ended broadcast groups; retried at the next start");
    }
}
