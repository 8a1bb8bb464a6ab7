//! HTTP API of the metadata server.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use kt_service::{ApiError, ApiJson, Metrics, Ready, Token};
use kt_types::api::{
    DeleteQuery, DeleteResponse, ListQuery, ListResponse, RegisterKey, RegisterStore, StoreLocation,
};
use kt_types::{ErrorCode, Key, KeyPrefix, KeyRecord, Locale};
use tokio::net::TcpListener;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::db::{Db, DbError};
use crate::registry::Registry;

/// Everything the server needs besides its listener.
#[derive(Debug, Clone)]
pub struct Config {
    pub state_dir: PathBuf,
    pub token: Token,
    /// Requests served at once; more wait.
    pub max_in_flight: usize,
    /// How often expired keys are swept.
    pub sweep_interval: Duration,
}

impl Config {
    /// Defaults for everything but the state directory and token.
    pub fn new(state_dir: impl Into<PathBuf>, token: Token) -> Self {
        Config {
            state_dir: state_dir.into(),
            token,
            max_in_flight: 512,
            sweep_interval: Duration::from_secs(5),
        }
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
}

struct Inner {
    registry: Mutex<Registry>,
    store_url: Mutex<Option<String>>,
    db: Db,
    http: reqwest::Client,
    token: Token,
}

type AppState = Arc<Inner>;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

fn db_err(e: DbError) -> ApiError {
    ApiError::internal(e.to_string())
}

/// Runs the metadata server on `listener` until `shutdown` is cancelled.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), MetadataError> {
    let (db, loaded) = Db::open(&config.state_dir)?;
    tracing::info!(keys = loaded.records.len(), state_dir = %config.state_dir.display(), "registry loaded");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .map_err(|e| MetadataError::Client(e.to_string()))?;
    let state: AppState = Arc::new(Inner {
        registry: Mutex::new(Registry::from_records(loaded.records)),
        store_url: Mutex::new(loaded.store_url),
        db,
        http,
        token: config.token.clone(),
    });
    let api = Router::new()
        .route("/api/v1/stores", post(register_store))
        .route("/api/v1/store", get(get_store))
        .route("/api/v1/keys", get(list_keys))
        .route(
            "/api/v1/keys/{*key}",
            get(get_key).put(put_key).delete(delete_key),
        )
        .with_state(state.clone());
    let ready = Ready::default();
    ready.set(true);
    let app = kt_service::app(
        api,
        config.token.clone(),
        Arc::new(Metrics::new()),
        ready,
        config.max_in_flight,
    );
    let sweeper = tokio::spawn(sweep_expired(
        state,
        config.sweep_interval,
        shutdown.clone(),
    ));
    tracing::info!(addr = %listener.local_addr()?, "metadata server listening");
    let served = kt_service::serve(listener, app, shutdown.clone(), Duration::from_secs(10)).await;
    shutdown.cancel();
    let _ = sweeper.await;
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
    if let Some(service) = &reg.options.service {
        Key::parse(service).map_err(|e| ApiError::bad_request(format!("service name: {e}")))?;
    }
    let mut reg_lock = s.registry.lock().await;
    let record = reg_lock.record_for(key, reg, now_ms());
    s.db.put_record(&record).map_err(db_err)?;
    reg_lock.insert(record.clone());
    Ok(ApiJson(record))
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

/// Deletes a key's data at its source, then its record.
async fn delete_one(s: &Inner, r: &KeyRecord) -> Result<(), ApiError> {
    if r.locale == Locale::Store {
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

async fn sweep_expired(s: AppState, every: Duration, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let expired = s.registry.lock().await.expired(now_ms());
        for r in expired {
            if let Err(e) = delete_one(&s, &r).await {
                tracing::warn!(key = %r.key, error = %e, "could not delete expired key; will retry");
            }
        }
    }
}
