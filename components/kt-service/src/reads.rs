//! The read half of the sync protocol, shared by every server that serves
//! trees (the store, and node agents for what they export):
//!
//! - `GET    /api/v1/trees/{key}` → the current manifest as a codec document
//!   ([`kt_types::api::ReadManifest`]), with a read lease that pins the version;
//! - `POST   /api/v1/reads/{lease}/batch` ([`BatchRequest`]) → a frame stream
//!   of the requested files;
//! - `GET    /api/v1/reads/{lease}/files/{index}?offset=O&len=L` → a byte range;
//! - `DELETE /api/v1/reads/{lease}` → release.
//!
//! What a key's current version is, and how it is pinned, belongs to the
//! server: it implements [`ReadSource`]. [`Reads`] holds the lease table,
//! answers the routes above, counts bytes and transfer durations in the
//! server's [`Metrics`], and releases leases a crashed getter left idle
//! ([`Reads::sweep`]).
//!
//! Only file entries of the pinned manifest are served, by index: a getter
//! can name nothing else. A source whose files live in a directory other
//! processes may change (an agent serving a user's tree) sets
//! [`OpenVersion::check_links`]: every file is then reached only through real
//! directories below the root (no symlink on the way) and opened without
//! following a final symlink, so nothing outside the exported tree is ever read.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::future::Future;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::allow;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use kt_sync::SyncError;
use kt_sync::batch::{SendItem, send_stream};
use kt_types::api::{BatchRequest, RangeQuery, ReadHeader};
use kt_types::auth::Role;
use kt_types::{Entry, EntryKind, ErrorCode, Key, Manifest};

use crate::{ApiError, ApiJson, Metrics};

/// Largest range one request may read.
pub const MAX_RANGE: u64 = 64 << 20;

/// Where the files of an opened version are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Files {
    /// Every entry at `dir.join(entry.path)` (trees, and the store's
    /// single-file keys, which it keeps inside a version directory).
    Under(PathBuf),
    /// A single-file manifest whose one file is this path, whatever the
    /// entry's name (a file exported or downloaded under another name).
    Single(PathBuf),
}

impl Files {
    /// Where `entry`'s content is.
    pub fn path_of(&self, entry: &Entry) -> PathBuf {
        match self {
            Files::Under(dir) => dir.join(&entry.path),
            Files::Single(file) => file.clone(),
        }
    }

    /// The directory the files of this version must stay in.
    fn root(&self) -> &Path {
        match self {
            Files::Under(dir) => dir,
            Files::Single(file) => file.parent().unwrap_or(file),
        }
    }
}

/// A version of a key opened for reading; the source keeps it available
/// until [`ReadSource::close`] is called with it.
#[derive(Debug, Clone)]
pub struct OpenVersion {
    pub key: Key,
    pub version: String,
    pub files: Files,
    pub manifest: Arc<Manifest>,
    /// Files above this size are fetched as ranges of this size.
    pub chunk_size: u64,
    /// The files live where others may change them: reach them only through
    /// real directories below the root (which must be canonical) and never
    /// through a final symlink.
    pub check_links: bool,
    /// The service owning the key, when the source knows it (the store:
    /// the service its put resolved); bytes sent are counted under it,
    /// else under a guess from the key ([`Metrics::add_bytes_out_for`]).
    pub owner: Option<String>,
}

/// What a server serves reads from.
pub trait ReadSource: Send + Sync + 'static {
    /// Opens the current version of `key`, pinned until [`ReadSource::close`].
    /// A key this source does not hold is `not_found`.
    fn open(&self, key: &Key) -> impl Future<Output = Result<OpenVersion, ApiError>> + Send;

    /// Releases what [`ReadSource::open`] pinned.
    fn close(&self, opened: &OpenVersion) -> impl Future<Output = ()> + Send;
}

/// Which service owns a key, as the metadata server records it: a server
/// asks before it serves a key to a token that reads only some services
/// ([`kt_types::auth::Principal::reads`]).
pub trait Owners: Send + Sync + 'static {
    /// The service `key` belongs to; an error when that cannot be told (the
    /// read is then refused: nothing is served on a guess).
    fn service_of<'a>(
        &'a self,
        key: &'a Key,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<String, ApiError>> + Send + 'a>>;
}

/// Checks that `who` may read `key`: at once for a token that reads every
/// service, else by asking `owners` which service the key belongs to.
pub async fn check_owner(
    owners: &dyn Owners,
    who: &kt_types::auth::Principal,
    key: &Key,
) -> Result<(), ApiError> {
    if who.reads_all() {
        return Ok(());
    }
    if who.scope.is_some() {
        // A capability: the metadata server checked the read when it
        // minted it; it reads its one key only.
        return crate::check_read(who, key, "");
    }
    let service = owners.service_of(key).await?;
    crate::check_read(who, key, &service)
}

/// A shared source is a source (a server keeps its own handle on it).
impl<T: ReadSource> ReadSource for Arc<T> {
    fn open(&self, key: &Key) -> impl Future<Output = Result<OpenVersion, ApiError>> + Send {
        (**self).open(key)
    }

    fn close(&self, opened: &OpenVersion) -> impl Future<Output = ()> + Send {
        (**self).close(opened)
    }
}

/// Maps sync-engine errors to API errors (one mapping for every server).
pub fn sync_err(e: SyncError) -> ApiError {
    let code = match &e {
        SyncError::HashMismatch { .. } => ErrorCode::HashMismatch,
        SyncError::Truncated => ErrorCode::Truncated,
        SyncError::UnexpectedEntry { .. }
        | SyncError::TrailingData
        | SyncError::SizeMismatch { .. }
        | SyncError::BadChunk { .. }
        | SyncError::Stream(_) => ErrorCode::InvalidRequest,
        SyncError::Manifest(_) | SyncError::LinkEscapes { .. } | SyncError::NonUtf8 { .. } => {
            ErrorCode::InvalidManifest
        }
        SyncError::NotFound { .. } => ErrorCode::NotFound,
        SyncError::Io { source, .. } if source.kind() == std::io::ErrorKind::StorageFull => {
            return ApiError::new(
                ErrorCode::InsufficientStorage,
                format!("store full: {e} (free room, or put less)"),
            );
        }
        SyncError::Io { .. } | SyncError::BadChunkSize(_) => ErrorCode::Internal,
    };
    ApiError::new(code, e.to_string())
}

impl From<SyncError> for ApiError {
    fn from(e: SyncError) -> Self {
        sync_err(e)
    }
}

/// Runs blocking file work off the async threads ([`kt_sync::task::blocking`]).
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, SyncError> + Send + 'static,
) -> Result<T, ApiError> {
    kt_sync::task::blocking(move || f().map_err(sync_err)).await
}

#[derive(Debug)]
struct Lease {
    opened: OpenVersion,
    started: Instant,
    touched: Mutex<Instant>,
}

impl Lease {
    fn touch(&self) {
        *self.touched.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    fn idle_since(&self) -> Instant {
        *self.touched.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn file(&self, index: u32) -> Result<&Entry, ApiError> {
        self.opened
            .manifest
            .entries
            .get(index as usize)
            .filter(|e| e.kind == EntryKind::File)
            .ok_or_else(|| {
                ApiError::bad_request(format!("entry #{index} is not a file of this version"))
            })
    }
}

/// The read leases of one server over its [`ReadSource`].
pub struct Reads<S> {
    source: S,
    owners: Arc<dyn Owners>,
    leases: Mutex<HashMap<String, Arc<Lease>>>,
    metrics: Arc<Metrics>,
    /// Leases idle for longer than this are released by [`Reads::sweep`].
    ttl: Duration,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Reads<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reads")
            .field("source", &self.source)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl<S: ReadSource> Reads<S> {
    pub fn new(
        source: S,
        owners: Arc<dyn Owners>,
        metrics: Arc<Metrics>,
        ttl: Duration,
    ) -> Arc<Self> {
        Arc::new(Reads {
            source,
            owners,
            leases: Mutex::new(HashMap::new()),
            metrics,
            ttl,
        })
    }

    pub fn source(&self) -> &S {
        &self.source
    }

    /// Open leases (for status and tests).
    pub fn open_leases(&self) -> usize {
        self.table().len()
    }

    /// The read routes (see the module documentation), with this state applied.
    pub fn routes(self: &Arc<Self>) -> Router {
        // Applications read (their kt client); nothing else needs to.
        const R: &[Role] = &[Role::Workload];
        Router::new()
            .route("/api/v1/trees/{*key}", allow(R, get(open::<S>)))
            .route("/api/v1/reads/{lease}/batch", allow(R, post(batch::<S>)))
            .route(
                "/api/v1/reads/{lease}/files/{index}",
                allow(R, get(range::<S>)),
            )
            .route("/api/v1/reads/{lease}", allow(R, delete(release::<S>)))
            .with_state(self.clone())
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Lease>>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lease(&self, id: &str) -> Result<Arc<Lease>, ApiError> {
        let l = self.table().get(id).cloned().ok_or_else(|| {
            ApiError::not_found(format!("no read lease {id:?} (expired or released)"))
        })?;
        l.touch();
        Ok(l)
    }

    /// Opens `key` and a lease on it: the read manifest document
    /// ([`kt_types::api::ReadManifest`]) a getter starts from.
    pub async fn open_lease(&self, key: &Key) -> Result<Vec<u8>, ApiError> {
        self.open_lease_of(key, None).await
    }

    /// [`Reads::open_lease`], only if the key is at `version` here (when
    /// given: a capability's); `conflict` otherwise.
    pub async fn open_lease_of(
        &self,
        key: &Key,
        version: Option<&str>,
    ) -> Result<Vec<u8>, ApiError> {
        let opened = self.source.open(key).await?;
        if let Some(v) = version.filter(|v| *v != opened.version) {
            let held = opened.version.clone();
            self.source.close(&opened).await;
            return Err(ApiError::new(
                kt_types::ErrorCode::Conflict,
                format!("{key} is at version {held} here, the capability reads {v}"),
            ));
        }
        let id = uuid::Uuid::new_v4().simple().to_string();
        let header = ReadHeader {
            version: opened.version.clone(),
            lease: id.clone(),
            chunk_size: opened.chunk_size,
        };
        let doc = kt_types::codec::encode_document(&header, &opened.manifest);
        let now = Instant::now();
        self.table().insert(
            id,
            Arc::new(Lease {
                opened,
                started: now,
                touched: Mutex::new(now),
            }),
        );
        Ok(doc)
    }

    /// Releases lease `id`: `not_found` when there is none.
    pub async fn release_lease(&self, id: &str) -> Result<(), ApiError> {
        let l = self
            .table()
            .remove(id)
            .ok_or_else(|| ApiError::not_found(format!("no read lease {id:?}")))?;
        self.metrics
            .observe_transfer("get", l.started.elapsed().as_secs_f64());
        self.source.close(&l.opened).await;
        Ok(())
    }

    /// Releases leases idle for longer than the TTL (a crashed getter);
    /// returns how many.
    pub async fn sweep(&self, now: Instant) -> usize {
        let stale: Vec<Arc<Lease>> = {
            let mut table = self.table();
            let ids: Vec<String> = table
                .iter()
                .filter(|(_, l)| now.saturating_duration_since(l.idle_since()) > self.ttl)
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| table.remove(id)).collect()
        };
        for l in &stale {
            self.source.close(&l.opened).await;
        }
        stale.len()
    }

    /// Releases every lease (at shutdown).
    pub async fn release_all(&self) {
        let all: Vec<Arc<Lease>> = self.table().drain().map(|(_, l)| l).collect();
        for l in all {
            self.source.close(&l.opened).await;
        }
    }
}

/// `GET /api/v1/trees/{key}`: only for a token that reads the key's service
/// (the lease it answers is the only way to the files).
async fn open<S: ReadSource>(
    State(r): State<Arc<Reads<S>>>,
    axum::Extension(who): axum::Extension<kt_types::auth::Principal>,
    UrlPath(key): UrlPath<String>,
) -> Result<Response, ApiError> {
    let key = Key::parse(&key)?;
    check_owner(r.owners.as_ref(), &who, &key).await?;
    let version = who.scope.as_ref().map(|s| s.version.as_str());
    let doc = r.open_lease_of(&key, version).await?;
    Ok((
        [(CONTENT_TYPE, kt_types::codec::DOCUMENT_CONTENT_TYPE)],
        doc,
    )
        .into_response())
}

/// `POST /api/v1/reads/{lease}/batch`: the requested files as one frame stream.
async fn batch<S: ReadSource>(
    State(r): State<Arc<Reads<S>>>,
    UrlPath(id): UrlPath<String>,
    ApiJson(req): ApiJson<BatchRequest>,
) -> Result<Body, ApiError> {
    let l = r.lease(&id)?;
    let mut items = Vec::with_capacity(req.indices.len());
    let mut bytes = 0;
    for &index in &req.indices {
        let e = l.file(index)?;
        bytes += e.size;
        items.push(SendItem {
            index,
            path: l.opened.files.path_of(e),
            size: e.size,
            entry_path: e.path.clone(),
            data: None,
            // Checked below, and opened without following a link that was
            // swapped in since.
            beneath: l
                .opened
                .check_links
                .then(|| l.opened.files.root().to_owned()),
        });
    }
    if l.opened.check_links {
        let files = l.opened.files.clone();
        items = kt_sync::task::blocking(move || {
            let mut checked = HashSet::new();
            for item in &items {
                confined(
                    &files,
                    (&item.path, item.size),
                    &item.entry_path,
                    &mut checked,
                )?;
            }
            Ok::<_, ApiError>(items)
        })
        .await?;
    }
    r.metrics
        .add_bytes_out_for(&l.opened.key, l.opened.owner.as_deref(), bytes);
    // Each file sent keeps the lease alive, however long the stream runs.
    let touch: kt_sync::batch::Progress = Arc::new(move |_| l.touch());
    Ok(Body::from_stream(send_stream(items, Some(touch))))
}

/// `GET /api/v1/reads/{lease}/files/{index}?offset=O&len=L`: a byte range of one file.
async fn range<S: ReadSource>(
    State(r): State<Arc<Reads<S>>>,
    UrlPath((id, index)): UrlPath<(String, u32)>,
    Query(q): Query<RangeQuery>,
) -> Result<Response, ApiError> {
    let l = r.lease(&id)?;
    let e = l.file(index)?;
    if q.len > MAX_RANGE || q.offset.checked_add(q.len).is_none_or(|end| end > e.size) {
        return Err(ApiError::bad_request(format!(
            "range {}+{} is outside {:?} ({} bytes) or longer than {MAX_RANGE}",
            q.offset, q.len, e.path, e.size
        )));
    }
    let path = l.opened.files.path_of(e);
    let entry_path = e.path.clone();
    let files = l.opened.files.clone();
    let check = l.opened.check_links;
    let size = e.size;
    let file = kt_sync::task::blocking(move || {
        if check {
            // No link on the way or at the end, a regular file: whatever
            // the files' owner swapped in since the export.
            let root = files.root();
            let rel = path.strip_prefix(root).unwrap_or(&path);
            let file = kt_sync::beneath::open_file_beneath(root, rel)
                .map_err(|e| changed(&entry_path, &e.to_string()))?;
            let now = file
                .metadata()
                .map_err(|e| changed(&entry_path, &e.to_string()))?;
            same_size(&entry_path, now.len(), size)?;
            Ok(file)
        } else {
            File::open(&path).map_err(|e| sync_err(SyncError::io(&path, e)))
        }
    })
    .await?;
    r.metrics
        .add_bytes_out_for(&l.opened.key, l.opened.owner.as_deref(), q.len);
    // Streamed in pieces: a source serving many readers at once holds a
    // piece per reader, not a whole range (a chunk, up to MAX_RANGE) each.
    let body = Body::from_stream(file_pieces(file, q.offset, q.len, RANGE_PIECE));
    Ok(([(CONTENT_LENGTH, q.len.to_string())], body).into_response())
}

/// How much of a range is read at a time.
const RANGE_PIECE: usize = 256 * 1024;

/// `len` bytes of `file` from `offset`, `piece` bytes at a time, each read
/// straight into the buffer that is sent: one copy and one trip to the
/// blocking threads per piece (an async file reads into a buffer of its own
/// first, then copies). A file that ends early ends the stream with an
/// error: the reader sees a short body.
pub fn file_pieces(
    file: File,
    offset: u64,
    len: u64,
    piece: usize,
) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static {
    let end = offset.saturating_add(len);
    let piece = piece.max(1) as u64;
    futures::stream::try_unfold((Arc::new(file), offset), move |(file, at)| async move {
        if at >= end {
            return Ok(None);
        }
        let n = (end - at).min(piece) as usize;
        let f = file.clone();
        let data = kt_sync::task::spawn(move || {
            let mut buf = vec![0u8; n];
            f.read_exact_at(&mut buf, at).map(|()| buf)
        })
        .await
        .map_err(|lost| std::io::Error::other(lost.to_string()))??;
        Ok(Some((Bytes::from(data), (file, at + n as u64))))
    })
}

/// `DELETE /api/v1/reads/{lease}`.
async fn release<S: ReadSource>(
    State(r): State<Arc<Reads<S>>>,
    UrlPath(id): UrlPath<String>,
) -> Result<StatusCode, ApiError> {
    r.release_lease(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The file of `entry_path` is no longer what was exported: a permanent
/// answer (`conflict`), logged here, where the owner of the files can act.
fn changed(entry_path: &str, why: &str) -> ApiError {
    tracing::warn!(file = %entry_path, why, "an exported file changed since it was put: getters are refused it until it is put again");
    ApiError::new(
        ErrorCode::Conflict,
        format!(
            "{entry_path:?} cannot be served: {why} (the exported files changed since the put: put the key again)"
        ),
    )
}

/// `changed` unless the file still has the size it was exported with.
fn same_size(entry_path: &str, now: u64, exported: u64) -> Result<(), ApiError> {
    if now == exported {
        return Ok(());
    }
    Err(changed(
        entry_path,
        &format!("it is {now} bytes now, {exported} when it was put"),
    ))
}

/// Checks that `path` is reached through real directories only, from the
/// (canonical) root down, and is itself a regular file, not a link.
/// `checked` remembers directories already found good.
fn confined(
    files: &Files,
    (path, size): (&Path, u64),
    entry_path: &str,
    checked: &mut HashSet<PathBuf>,
) -> Result<(), ApiError> {
    let root = files.root();
    let parent = path.parent().unwrap_or(root);
    if !parent.starts_with(root) {
        return Err(changed(entry_path, "outside the exported tree"));
    }
    if !checked.contains(parent) {
        // A canonical path equal to the path itself means no component is a link.
        match std::fs::canonicalize(parent) {
            Ok(real) if real == parent => {
                checked.insert(parent.to_owned());
            }
            Ok(_) => return Err(changed(entry_path, "a directory on its way is a symlink")),
            Err(e) => return Err(changed(entry_path, &e.to_string())),
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.is_file() => same_size(entry_path, md.len(), size),
        Ok(_) => Err(changed(entry_path, "not a regular file")),
        Err(e) => Err(changed(entry_path, &e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_is_a_final_answer_naming_it() {
        let full = SyncError::io(
            Path::new("/data/keys/k/v-1/f"),
            std::io::Error::from(std::io::ErrorKind::StorageFull),
        );
        let e = sync_err(full);
        assert_eq!(e.code, ErrorCode::InsufficientStorage);
        assert_eq!(e.code.http_status(), 507);
        assert!(e.message.starts_with("store full: "), "{}", e.message);
        let other = sync_err(SyncError::io(
            Path::new("/x"),
            std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        ));
        assert_eq!(other.code, ErrorCode::Internal);
    }

    async fn collect(
        s: impl futures::Stream<Item = std::io::Result<Bytes>>,
    ) -> (Vec<usize>, Vec<u8>, Option<std::io::Error>) {
        use futures::StreamExt;
        let mut s = std::pin::pin!(s);
        let (mut sizes, mut all) = (Vec::new(), Vec::new());
        while let Some(item) = s.next().await {
            match item {
                Ok(b) => {
                    sizes.push(b.len());
                    all.extend_from_slice(&b);
                }
                Err(e) => return (sizes, all, Some(e)),
            }
        }
        (sizes, all, None)
    }

    /// A range goes out in pieces of at most `piece` bytes, from its offset,
    /// whether or not it starts or ends on a piece boundary.
    #[tokio::test]
    async fn a_range_is_read_in_pieces_from_its_offset() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let open = || File::open(&p).unwrap();
        let (sizes, got, err) = collect(file_pieces(open(), 1000, 5000, 2048)).await;
        assert!(err.is_none());
        assert_eq!(sizes, vec![2048, 2048, 904]);
        assert_eq!(got, &data[1000..6000]);
        // Exactly two pieces; a range of nothing; the last byte.
        let (sizes, _, _) = collect(file_pieces(open(), 0, 4096, 2048)).await;
        assert_eq!(sizes, vec![2048, 2048]);
        let (sizes, _, err) = collect(file_pieces(open(), 10_000, 0, 2048)).await;
        assert!(sizes.is_empty() && err.is_none());
        let (_, got, _) = collect(file_pieces(open(), 9_999, 1, 2048)).await;
        assert_eq!(got, &data[9_999..]);
    }

    /// A file cut short since it was opened: the pieces that were there,
    /// then an error, never a short piece passed off as the rest.
    #[tokio::test]
    async fn a_range_of_a_file_cut_short_ends_in_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, vec![5u8; 3000]).unwrap();
        let (sizes, got, err) = collect(file_pieces(File::open(&p).unwrap(), 0, 5000, 2048)).await;
        assert_eq!(sizes, vec![2048]);
        assert_eq!(got.len(), 2048);
        assert_eq!(err.unwrap().kind(), std::io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn files_resolve_entries() {
        let e = Entry {
            path: "a/b.txt".into(),
            kind: EntryKind::File,
            size: 1,
            mode: 0o644,
            mtime: 0,
            mtime_nsec: 0,
            hash: None,
            target: None,
        };
        assert_eq!(
            Files::Under("/x".into()).path_of(&e),
            PathBuf::from("/x/a/b.txt")
        );
        assert_eq!(
            Files::Single("/y/other".into()).path_of(&e),
            PathBuf::from("/y/other")
        );
    }

    #[test]
    fn confinement_refuses_links_on_the_way() {
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root.join("d")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(root.join("d/f"), b"ok").unwrap();
        std::fs::write(outside.join("secret"), b"no").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("l")).unwrap();
        std::os::unix::fs::symlink(outside.join("secret"), root.join("d/s")).unwrap();
        let files = Files::Under(root.clone());
        let mut seen = HashSet::new();
        let f = root.join("d/f");
        assert!(confined(&files, (&f, 2), "d/f", &mut seen).is_ok());
        for rel in ["l/secret", "d/s", "d/missing"] {
            let err = confined(&files, (&root.join(rel), 2), rel, &mut seen).unwrap_err();
            assert_eq!(err.code, ErrorCode::Conflict, "{rel}: {err}");
        }
        // Grown since it was exported: refused, saying so.
        let err = confined(&files, (&f, 1), "d/f", &mut seen).unwrap_err();
        assert_eq!(err.code, ErrorCode::Conflict);
        assert!(
            err.message.contains("2 bytes now, 1 when it was put"),
            "{err}"
        );
        let single = Files::Single(f.clone());
        assert!(confined(&single, (&f, 2), "f", &mut HashSet::new()).is_ok());
        let via_link = Files::Single(root.join("l/secret"));
        assert!(
            confined(
                &via_link,
                (&root.join("l/secret"), 2),
                "f",
                &mut HashSet::new()
            )
            .is_err()
        );
    }
}
