//! Read leases: a get pins the version it started on until it is done.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use kt_service::{ApiError, ApiJson};
use kt_sync::SyncError;
use kt_sync::batch::{SendItem, send_stream};
use kt_types::api::{
    BatchRequest, DeleteResponse, RangeQuery, ReadManifest, TreeDeleteQuery, TreeList,
};
use kt_types::{EntryKind, Key};

use crate::keys::{Published, VersionMeta};
use crate::put::remove_versions;
use crate::server::{AppState, Shared, blocking};

/// Largest range one request may read.
const MAX_RANGE: u64 = 64 << 20;

#[derive(Debug)]
pub struct ReadLease {
    key: Key,
    version: String,
    root: PathBuf,
    meta: Arc<VersionMeta>,
    opened: Instant,
    touched: Mutex<Instant>,
}

impl ReadLease {
    fn touch(&self) {
        *self.touched.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }
}

fn lease(s: &Shared, id: &str) -> Result<Arc<ReadLease>, ApiError> {
    let found = s
        .reads
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(id)
        .cloned();
    let l = found.ok_or_else(|| {
        ApiError::not_found(format!("no read lease {id:?} (expired or released)"))
    })?;
    l.touch();
    Ok(l)
}

type Locked = tokio::sync::OwnedMutexGuard<crate::keys::KeyState>;

/// A published key: its name, its locked state and its current version; or `not_found`.
async fn published(s: &Shared, raw: &str) -> Result<(Key, Locked, Published), ApiError> {
    let key = Key::parse(raw)?;
    let missing = || ApiError::not_found(format!("key {key} not found in the store"));
    let state = s.keys.existing(&key).ok_or_else(missing)?;
    let st = state.lock_owned().await;
    let cur = st.current.clone().ok_or_else(missing)?;
    Ok((key, st, cur))
}

/// `GET /api/v1/trees/{key}`: the current manifest, with a lease pinning its version.
pub async fn open(
    State(s): State<AppState>,
    Path(key): Path<String>,
) -> Result<impl axum::response::IntoResponse, ApiError> {
    let (key, mut st, cur) = published(&s, &key).await?;
    st.pin(&cur.version);
    drop(st);
    let id = uuid::Uuid::new_v4().simple().to_string();
    let root = s.keys.dir_of(&key).version_path(&cur.version);
    let l = Arc::new(ReadLease {
        key,
        version: cur.version.clone(),
        root,
        meta: cur.meta.clone(),
        opened: Instant::now(),
        touched: Mutex::new(Instant::now()),
    });
    s.reads
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id.clone(), l);
    let doc = ReadManifest {
        version: cur.version,
        lease: id,
        chunk_size: s.cfg.chunk_size,
        manifest: cur.meta.manifest.clone(),
    }
    .to_document();
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            kt_types::codec::DOCUMENT_CONTENT_TYPE,
        )],
        doc,
    ))
}

fn file_entry(l: &ReadLease, index: u32) -> Result<&kt_types::Entry, ApiError> {
    l.meta
        .manifest
        .entries
        .get(index as usize)
        .filter(|e| e.kind == EntryKind::File)
        .ok_or_else(|| {
            ApiError::bad_request(format!("entry #{index} is not a file of this version"))
        })
}

/// `POST /api/v1/reads/{lease}/batch`: the requested files as one frame stream.
pub async fn batch(
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<BatchRequest>,
) -> Result<Body, ApiError> {
    let l = lease(&s, &id)?;
    let mut items = Vec::with_capacity(req.indices.len());
    let mut bytes = 0;
    for &index in &req.indices {
        let e = file_entry(&l, index)?;
        bytes += e.size;
        items.push(SendItem {
            index,
            path: l.root.join(&e.path),
            size: e.size,
            entry_path: e.path.clone(),
            data: None,
        });
    }
    s.metrics.add_bytes_out(bytes);
    // Each file sent keeps the lease alive, however long the stream runs.
    let touch: kt_sync::batch::Progress = Arc::new(move |_| l.touch());
    Ok(Body::from_stream(send_stream(items, Some(touch))))
}

/// `GET /api/v1/reads/{lease}/files/{index}?offset=O&len=L`: a byte range of one file.
pub async fn range(
    State(s): State<AppState>,
    Path((id, index)): Path<(String, u32)>,
    Query(q): Query<RangeQuery>,
) -> Result<Bytes, ApiError> {
    let l = lease(&s, &id)?;
    let e = file_entry(&l, index)?;
    if q.len > MAX_RANGE || q.offset.checked_add(q.len).is_none_or(|end| end > e.size) {
        return Err(ApiError::bad_request(format!(
            "range {}+{} is outside {:?} ({} bytes) or longer than {MAX_RANGE}",
            q.offset, q.len, e.path, e.size
        )));
    }
    let path = l.root.join(&e.path);
    let data = blocking(move || {
        let f = std::fs::File::open(&path).map_err(|e| SyncError::io(&path, e))?;
        let mut buf = vec![0u8; q.len as usize];
        f.read_exact_at(&mut buf, q.offset)
            .map_err(|e| SyncError::io(&path, e))?;
        Ok(buf)
    })
    .await?;
    s.metrics.add_bytes_out(q.len);
    Ok(Bytes::from(data))
}

async fn drop_lease(s: &Shared, l: Arc<ReadLease>) {
    let Some(state) = s.keys.existing(&l.key) else {
        return;
    };
    let free = state.lock().await.unpin(&l.version);
    remove_versions(&s.keys.dir_of(&l.key), free).await;
}

/// `DELETE /api/v1/reads/{lease}`.
pub async fn release(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let l = s
        .reads
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&id)
        .ok_or_else(|| ApiError::not_found(format!("no read lease {id:?}")))?;
    s.metrics
        .observe_transfer("get", l.opened.elapsed().as_secs_f64());
    drop_lease(&s, l).await;
    Ok(StatusCode::NO_CONTENT)
}

/// Releases leases idle for longer than the lease TTL (a crashed getter).
pub async fn sweep(s: &Shared, now: Instant) {
    let stale: Vec<Arc<ReadLease>> = {
        let mut reads = s.reads.lock().unwrap_or_else(|p| p.into_inner());
        let ids: Vec<String> = reads
            .iter()
            .filter(|(_, l)| {
                now.duration_since(*l.touched.lock().unwrap_or_else(|p| p.into_inner()))
                    > s.cfg.lease_ttl
            })
            .map(|(id, _)| id.clone())
            .collect();
        ids.iter().filter_map(|id| reads.remove(id)).collect()
    };
    for l in stale {
        drop_lease(s, l).await;
    }
}

/// `DELETE /api/v1/trees/{key}`: removes a key and all its versions.
pub async fn delete_tree(
    State(s): State<AppState>,
    Path(key): Path<String>,
    Query(q): Query<TreeDeleteQuery>,
) -> Result<ApiJson<DeleteResponse>, ApiError> {
    let (key, mut st, cur) = published(&s, &key).await?;
    if let Some(v) = q.version.filter(|v| *v != cur.version) {
        return Err(ApiError::new(
            kt_types::ErrorCode::Conflict,
            format!("{key} is at version {}, not {v}", cur.version),
        ));
    }
    let dir = s.keys.dir_of(&key);
    blocking(move || dir.remove_all()).await?;
    st.current = None;
    s.keys.forget(&key);
    s.registrar.forget(&key).await;
    tracing::info!(%key, "tree deleted");
    Ok(ApiJson(DeleteResponse { deleted: vec![key] }))
}

/// `GET /api/v1/trees`: every key the store holds.
pub async fn list(State(s): State<AppState>) -> ApiJson<TreeList> {
    let mut keys = Vec::new();
    for (k, st) in s.keys.all() {
        if st.lock().await.current.is_some() {
            keys.push(k);
        }
    }
    keys.sort();
    ApiJson(TreeList { keys })
}
