//! The relay of a broadcast getter: it serves, over the read protocol of
//! [`kt_service::reads`], the version it is downloading, while it downloads
//! it (cut-through). A child asking for bytes its parent does not have yet
//! waits for them; a parent that stops making progress answers
//! `unavailable`, and the child asks the metadata server for another parent.
//!
//! The [`Board`] is what the download tells the relay: the manifest, each
//! file placed, and how far each chunk of a large file is written. A range
//! is served in pieces as they land ([`PIECE`] at most, often less), not
//! chunk by chunk: a relay forwards bytes it got a moment ago, so a chain of
//! relays adds a piece's time per hop, not a chunk's. Partially written
//! files are read through their own handle, which stays valid when the file
//! is renamed into place. What a relay forwards before its chunk is complete
//! is not verified yet: every member verifies its own copy (chunk chaining
//! values against the file's hash), so a bad piece costs a refetch, never a
//! bad copy.
//!
//! The pieces that landed last ([`RECENT`] bytes of them) are kept in
//! memory as they came off the wire and served from there: a child in a
//! chain asks for what its parent got a moment ago, which then costs
//! neither a read of the file back nor a trip to the blocking threads.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use futures::StreamExt;
use kt_service::reads::MAX_RANGE;
use kt_service::{ApiError, ApiJson, Metrics, Ready, Token};
use kt_types::api::{BatchRequest, RangeQuery, ReadHeader, ReadManifest};
use kt_types::{EntryKind, ErrorCode, Key, frame};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::error::ClientError;

/// A reader waiting this long without the download moving on gets
/// `unavailable` (its parent is stuck; it had better move).
pub const STALL: Duration = Duration::from_secs(20);

/// The most a range answer reads and sends at once.
pub const PIECE: u64 = 256 << 10;

/// How many bytes of the pieces landed last a relay keeps in memory to
/// serve them from there (a few pieces of each chunk being fetched).
pub const RECENT: u64 = 8 << 20;

/// Where the bytes of one file are.
#[derive(Debug)]
enum Avail {
    /// Complete, at this path.
    At(PathBuf),
    /// Being written in chunks of `chunk` bytes; `have[n]`: how many bytes
    /// of chunk `n`, from its start, are written (`chunk` once it is whole,
    /// also for a shorter last chunk).
    Partial {
        file: Arc<File>,
        chunk: u64,
        have: Vec<u64>,
    },
}

impl Avail {
    /// How many bytes from `offset` on (at most `max`) can be read now.
    fn ready_at(&self, offset: u64, max: u64) -> u64 {
        let Avail::Partial { chunk, have, .. } = self else {
            return max;
        };
        let (mut ready, mut at) = (0, offset);
        while ready < max {
            let within = at % chunk;
            let got = have.get((at / chunk) as usize).copied().unwrap_or(0);
            if got <= within {
                break;
            }
            let take = (got - within).min(max - ready);
            ready += take;
            at += take;
            if got < *chunk {
                // The rest of this chunk is not written yet.
                break;
            }
        }
        ready
    }

    fn covers(&self, offset: u64, len: u64) -> bool {
        self.ready_at(offset, len) == len
    }

    fn source(&self) -> Src {
        match self {
            Avail::At(p) => Src::Path(p.clone()),
            Avail::Partial { file, .. } => Src::File(file.clone()),
        }
    }
}

/// What a read opens: a complete file, or the one being written.
enum Src {
    Path(PathBuf),
    File(Arc<File>),
}

impl Src {
    /// Reads `len` bytes at `offset` (blocking).
    fn read(self, offset: u64, len: u64) -> Result<Vec<u8>, kt_sync::SyncError> {
        let mut buf = vec![0u8; len as usize];
        match self {
            Src::Path(p) => File::open(&p)
                .and_then(|f| f.read_exact_at(&mut buf, offset))
                .map_err(|e| kt_sync::SyncError::io(&p, e))?,
            Src::File(f) => f
                .read_exact_at(&mut buf, offset)
                .map_err(|e| kt_sync::SyncError::io("(file being downloaded)", e))?,
        }
        Ok(buf)
    }
}

#[derive(Debug, Default)]
struct State_ {
    key: Option<Key>,
    read: Option<Arc<ReadManifest>>,
    files: HashMap<u32, Avail>,
    failed: Option<String>,
    recent: Recent,
}

/// Bytes that landed at `offset` of file `index`, as they came.
#[derive(Debug)]
struct Landed {
    index: u32,
    offset: u64,
    data: Bytes,
}

/// The pieces landed last, oldest first, [`RECENT`] bytes of them at most.
#[derive(Debug, Default)]
struct Recent {
    pieces: VecDeque<Landed>,
    bytes: u64,
}

impl Recent {
    fn keep(&mut self, index: u32, mut offset: u64, data: Vec<Bytes>) {
        for data in data.into_iter().filter(|d| !d.is_empty()) {
            let len = data.len() as u64;
            self.bytes += len;
            self.pieces.push_back(Landed {
                index,
                offset,
                data,
            });
            offset += len;
        }
        while self.bytes > RECENT
            && let Some(old) = self.pieces.pop_front()
        {
            self.bytes -= old.data.len() as u64;
        }
    }

    /// Up to `max` bytes at `offset` of file `index`, if they are kept
    /// (from one landed piece: perhaps fewer than are ready).
    fn get(&self, index: u32, offset: u64, max: u64) -> Option<Bytes> {
        let p = self.pieces.iter().rev().find(|p| {
            p.index == index && p.offset <= offset && offset < p.offset + p.data.len() as u64
        })?;
        let from = (offset - p.offset) as usize;
        let to = (from as u64 + max).min(p.data.len() as u64) as usize;
        Some(p.data.slice(from..to))
    }

    fn forget(&mut self, index: u32) {
        self.pieces.retain(|p| p.index != index);
        self.bytes = self.pieces.iter().map(|p| p.data.len() as u64).sum();
    }
}

/// A pause this long or longer with no byte from any source counts as
/// waiting on the parent in [`Timings::waited`] (shorter ones are the
/// link's pace).
pub const GAP: Duration = Duration::from_millis(50);

/// Where a broadcast getter's time went, as its download tells its
/// [`Board`]: when content bytes came, the pauses between them, and the
/// time its pieces took to hash and to write (summed over the parallel
/// streams, so they may exceed the wall time). Each frame costs a clock
/// read and two atomic operations, nothing more.
#[derive(Debug)]
pub struct Timings {
    start: Instant,
    /// ns after `start` of the first and of the last content frame (0:
    /// none yet).
    first: AtomicU64,
    last: AtomicU64,
    /// ns of pauses of [`GAP`] or more between frames (from any source).
    waited: AtomicU64,
    hash: AtomicU64,
    write: AtomicU64,
}

impl Default for Timings {
    fn default() -> Self {
        Timings {
            start: Instant::now(),
            first: AtomicU64::new(0),
            last: AtomicU64::new(0),
            waited: AtomicU64::new(0),
            hash: AtomicU64::new(0),
            write: AtomicU64::new(0),
        }
    }
}

fn nanos(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

impl Timings {
    fn now(&self) -> u64 {
        nanos(self.start.elapsed()).max(1)
    }

    fn at(&self, ns: &AtomicU64) -> Option<Instant> {
        match ns.load(Ordering::Relaxed) {
            0 => None,
            n => Some(self.start + Duration::from_nanos(n)),
        }
    }

    /// A frame of content came from a source.
    pub fn frame(&self) {
        let now = self.now();
        if self.first.load(Ordering::Relaxed) == 0 {
            let _ = self
                .first
                .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed);
        }
        let before = self.last.fetch_max(now, Ordering::Relaxed);
        let gap = now.saturating_sub(before);
        if before != 0 && gap >= nanos(GAP) {
            self.waited.fetch_add(gap, Ordering::Relaxed);
        }
    }

    /// A piece took `hash` to hash and `write` to write.
    pub fn piece(&self, hash: Duration, write: Duration) {
        self.hash.fetch_add(nanos(hash), Ordering::Relaxed);
        self.write.fetch_add(nanos(write), Ordering::Relaxed);
    }

    /// When the first content byte came, if one did.
    pub fn first_byte(&self) -> Option<Instant> {
        self.at(&self.first)
    }

    /// When the last content byte so far came, if one did.
    pub fn last_byte(&self) -> Option<Instant> {
        self.at(&self.last)
    }

    /// The pauses of [`GAP`] or more between content bytes, summed.
    pub fn waited(&self) -> Duration {
        Duration::from_nanos(self.waited.load(Ordering::Relaxed))
    }

    /// Time spent hashing pieces (verifying them), summed over streams.
    pub fn hashing(&self) -> Duration {
        Duration::from_nanos(self.hash.load(Ordering::Relaxed))
    }

    /// Time spent writing pieces, summed over streams.
    pub fn writing(&self) -> Duration {
        Duration::from_nanos(self.write.load(Ordering::Relaxed))
    }
}

/// What a download has, for its relay (see the module documentation).
#[derive(Debug)]
pub struct Board {
    state: Mutex<State_>,
    changed: watch::Sender<u64>,
    /// ns after `timings.start` of the last change (0: none yet).
    changed_at: AtomicU64,
    lease: String,
    served: AtomicU64,
    /// How long a reader waits without a change ([`STALL`]).
    stall: Duration,
    /// Where the download's time went.
    pub timings: Timings,
}

impl Default for Board {
    fn default() -> Self {
        Board {
            state: Mutex::default(),
            changed: watch::Sender::new(0),
            changed_at: AtomicU64::new(0),
            lease: format!("relay-{}", uuid::Uuid::new_v4().simple()),
            served: AtomicU64::new(0),
            stall: STALL,
            timings: Timings::default(),
        }
    }
}

impl Board {
    fn update(&self, f: impl FnOnce(&mut State_)) {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()));
        self.changed_at.store(self.timings.now(), Ordering::Relaxed);
        self.changed.send_modify(|g| *g += 1);
    }

    /// When the download last told the board something (or the board was
    /// made).
    fn last_change(&self) -> Instant {
        self.timings.start + Duration::from_nanos(self.changed_at.load(Ordering::Relaxed))
    }

    /// The version being downloaded: the relay starts answering.
    pub fn publish(&self, key: &Key, read: &ReadManifest) {
        let read = Arc::new(read.clone());
        self.update(|s| {
            s.key = Some(key.clone());
            s.read = Some(read);
        });
    }

    /// File `index` is complete at `path`.
    pub fn file_at(&self, index: u32, path: PathBuf) {
        self.update(|s| {
            s.files.insert(index, Avail::At(path));
        });
    }

    /// File `index` is being written in chunks through `file`; `have[n]`
    /// once chunk `n` is whole.
    pub fn partial(&self, index: u32, file: File, chunk: u64, have: &[bool]) {
        let file = Arc::new(file);
        let have = have.iter().map(|&h| if h { chunk } else { 0 }).collect();
        self.update(|s| {
            s.recent.forget(index);
            s.files.insert(index, Avail::Partial { file, chunk, have });
        });
    }

    /// The first `bytes` of chunk `n` of file `index` are written (a piece
    /// landed; never takes back what was said before).
    pub fn piece(&self, index: u32, n: u64, bytes: u64) {
        self.landed(index, n, bytes, (0, Vec::new()));
    }

    /// [`Board::piece`], and what landed: `data`, written at `offset` of
    /// the file, one buffer after the other (kept a while, see [`RECENT`]).
    pub fn landed(&self, index: u32, n: u64, bytes: u64, (offset, data): (u64, Vec<Bytes>)) {
        self.update(|s| {
            if let Some(Avail::Partial { have, chunk, .. }) = s.files.get_mut(&index)
                && let Some(h) = have.get_mut(n as usize)
            {
                *h = (*h).max(bytes.min(*chunk));
                s.recent.keep(index, offset, data);
            }
        });
    }

    /// Chunk `n` of file `index` is written.
    pub fn chunk(&self, index: u32, n: u64) {
        self.piece(index, n, u64::MAX);
    }

    /// File `index` is being started over (its chunks did not verify).
    pub fn forget(&self, index: u32) {
        self.update(|s| {
            s.recent.forget(index);
            s.files.remove(&index);
        });
    }

    /// The download gave up: waiting readers are answered at once.
    pub fn fail(&self, reason: impl Into<String>) {
        let reason = reason.into();
        self.update(|s| s.failed = Some(reason));
    }

    /// Bytes served to children so far.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// Waits until `ready` finds what it needs, the download fails, or it
    /// stalls for [`STALL`] (nothing changed for that long while it
    /// waited). One timer for the whole wait, armed when it first has to
    /// wait and moved on only when it fires: the changes that wake it (a
    /// piece landed, of any chunk) touch no timer.
    async fn wait<T>(
        &self,
        mut ready: impl FnMut(&State_) -> Option<Result<T, ApiError>>,
    ) -> Result<T, ApiError> {
        let mut rx = self.changed.subscribe();
        let mut timer: Option<(Instant, std::pin::Pin<Box<tokio::time::Sleep>>)> = None;
        loop {
            {
                let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(r) = ready(&s) {
                    return r;
                }
                if let Some(why) = &s.failed {
                    return Err(ApiError::new(
                        ErrorCode::Unavailable,
                        format!("this relay's download failed: {why}"),
                    ));
                }
            }
            let (since, sleep) = timer.get_or_insert_with(|| {
                let now = Instant::now();
                (
                    now,
                    Box::pin(tokio::time::sleep_until((now + self.stall).into())),
                )
            });
            let stalled = tokio::select! {
                changed = rx.changed() => changed.is_err(),
                () = sleep.as_mut() => {
                    // Due STALL after the last change seen while waiting.
                    let due = self.last_change().max(*since) + self.stall;
                    if Instant::now() < due {
                        sleep.as_mut().reset(due.into());
                        false
                    } else {
                        true
                    }
                }
            };
            if stalled {
                return Err(ApiError::new(
                    ErrorCode::Unavailable,
                    format!("this relay made no progress for {:?}", self.stall),
                ));
            }
        }
    }

    async fn read(&self) -> Result<Arc<ReadManifest>, ApiError> {
        self.wait(|s| s.read.clone().map(Ok)).await
    }

    /// Waits until `len` bytes at `offset` of file `index` are there, then reads them.
    async fn read_range(&self, index: u32, offset: u64, len: u64) -> Result<Bytes, ApiError> {
        let src = self
            .wait(|s| {
                let a = s.files.get(&index)?;
                a.covers(offset, len).then(|| Ok(a.source()))
            })
            .await?;
        let data = kt_service::blocking(move || src.read(offset, len)).await?;
        self.served.fetch_add(len, Ordering::Relaxed);
        Ok(Bytes::from(data))
    }

    /// Reads the next piece at `offset` of file `index`, up to `end`: what
    /// is there as soon as anything is (at most [`PIECE`]), from memory
    /// when it landed a moment ago.
    async fn read_piece(&self, index: u32, offset: u64, end: u64) -> Result<Bytes, ApiError> {
        let (src, len, kept) = self
            .wait(|s| {
                let a = s.files.get(&index)?;
                let ready = a.ready_at(offset, (end - offset).min(PIECE));
                (ready > 0).then(|| Ok((a.source(), ready, s.recent.get(index, offset, ready))))
            })
            .await?;
        let data = match kept {
            Some(data) => data,
            None => Bytes::from(kt_service::blocking(move || src.read(offset, len)).await?),
        };
        self.served.fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(data)
    }

    /// `len` bytes at `offset` of file `index`, piece by piece as they land.
    /// On an error the stream just stops: the reader sees a short body.
    fn stream_range(
        self: Arc<Self>,
        index: u32,
        offset: u64,
        len: u64,
    ) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static {
        let end = offset + len;
        futures::stream::unfold(Some(offset), move |at| {
            let b = self.clone();
            async move {
                let at = at.filter(|&at| at < end)?;
                match b.read_piece(index, at, end).await {
                    Ok(data) => {
                        let next = at + data.len() as u64;
                        Some((Ok(data), Some(next)))
                    }
                    Err(e) => Some((Err(std::io::Error::other(e.to_string())), None)),
                }
            }
        })
    }
}

type Shared = Arc<Board>;

fn check_lease(b: &Board, id: &str) -> Result<(), ApiError> {
    if id == b.lease {
        Ok(())
    } else {
        Err(ApiError::not_found(format!("no read lease {id:?}")))
    }
}

/// The size of file `index` of the version being relayed.
fn file_size(read: &ReadManifest, index: u32) -> Result<u64, ApiError> {
    read.manifest
        .entries
        .get(index as usize)
        .filter(|e| e.kind == EntryKind::File)
        .map(|e| e.size)
        .ok_or_else(|| {
            ApiError::bad_request(format!("entry #{index} is not a file of this version"))
        })
}

async fn open(
    State(b): State<Shared>,
    UrlPath(key): UrlPath<String>,
) -> Result<Response, ApiError> {
    let key = Key::parse(&key)?;
    let read = b.read().await?;
    let relaying = b
        .state
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .key
        .clone();
    if relaying.as_ref() != Some(&key) {
        return Err(ApiError::not_found(format!(
            "this relay serves no key {key}"
        )));
    }
    let header = ReadHeader {
        version: read.version.clone(),
        lease: b.lease.clone(),
        chunk_size: read.chunk_size,
    };
    let doc = kt_types::codec::encode_document(&header, &read.manifest);
    Ok((
        [(CONTENT_TYPE, kt_types::codec::DOCUMENT_CONTENT_TYPE)],
        doc,
    )
        .into_response())
}

async fn batch(
    State(b): State<Shared>,
    UrlPath(id): UrlPath<String>,
    ApiJson(req): ApiJson<BatchRequest>,
) -> Result<Body, ApiError> {
    check_lease(&b, &id)?;
    let read = b.read().await?;
    let mut files = Vec::with_capacity(req.indices.len());
    for &i in &req.indices {
        let size = file_size(&read, i)?;
        // Batches carry small files; larger ones go by ranges.
        if size > read.chunk_size {
            return Err(ApiError::bad_request(format!(
                "entry #{i} ({size} bytes) is larger than a chunk: fetch it by ranges"
            )));
        }
        files.push((i, size));
    }
    // One record per file, each sent as soon as the file is there.
    let records = futures::stream::unfold(
        (b, files.into_iter(), false),
        |(b, mut files, ended)| async move {
            if ended {
                return None;
            }
            let Some((i, size)) = files.next() else {
                let end = Bytes::copy_from_slice(&frame::encode_end());
                return Some((Ok(end), (b, files, true)));
            };
            let item = match b.read_range(i, 0, size).await {
                Ok(data) => {
                    let mut rec = Vec::with_capacity(frame::HEADER_LEN + data.len());
                    rec.extend_from_slice(&frame::encode(i, size));
                    rec.extend_from_slice(&data);
                    Ok(Bytes::from(rec))
                }
                // The body just stops: the child sees a truncated stream.
                Err(e) => Err(std::io::Error::other(e.to_string())),
            };
            let stop = item.is_err();
            Some((item, (b, files, stop)))
        },
    );
    Ok(Body::from_stream(records))
}

async fn range(
    State(b): State<Shared>,
    UrlPath((id, index)): UrlPath<(String, u32)>,
    Query(q): Query<RangeQuery>,
) -> Result<Body, ApiError> {
    check_lease(&b, &id)?;
    let read = b.read().await?;
    let size = file_size(&read, index)?;
    if q.len > MAX_RANGE || q.offset.checked_add(q.len).is_none_or(|end| end > size) {
        return Err(ApiError::bad_request(format!(
            "range {}+{} is outside entry #{index} ({size} bytes) or longer than {MAX_RANGE}",
            q.offset, q.len
        )));
    }
    if q.len == 0 {
        return Ok(Body::empty());
    }
    // The first piece before the answer: a relay with nothing to send
    // answers with its error (`unavailable`), not a short body.
    let end = q.offset + q.len;
    let first = b.read_piece(index, q.offset, end).await?;
    let rest = b.stream_range(
        index,
        q.offset + first.len() as u64,
        end - q.offset - first.len() as u64,
    );
    Ok(Body::from_stream(
        futures::stream::once(async { Ok(first) }).chain(rest),
    ))
}

async fn release(
    State(b): State<Shared>,
    UrlPath(id): UrlPath<String>,
) -> Result<StatusCode, ApiError> {
    check_lease(&b, &id)?;
    Ok(StatusCode::NO_CONTENT)
}

/// A running relay.
#[derive(Debug)]
pub struct Relay {
    pub url: String,
    pub board: Arc<Board>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// The ports `KT_RELAY_PORT` names: `8091`, `8091-8099`, or `0` (any);
/// empty: the default range.
pub fn relay_ports(spec: &str) -> Result<Vec<u16>, String> {
    kt_types::env::ports(kt_types::env::RELAY_PORT, spec, DEFAULT_RELAY_PORTS)
}

/// The relay ports tried by default (the NetworkPolicy of kt's bundle opens them).
pub const DEFAULT_RELAY_PORTS: &str = "8091-8099";

impl Relay {
    /// Serves `board` on `ip`, behind `token` and `key` (the group's
    /// children present it, [`kt_types::broadcast::Parent::key`]): on the first free port of
    /// `KT_RELAY_PORT` (a port or a range, default 8091-8099, the ports a
    /// NetworkPolicy opens), else on one of the system's choosing.
    pub async fn start(ip: &str, token: &str, key: &str) -> Result<Relay, ClientError> {
        let addr: std::net::IpAddr = ip
            .parse()
            .map_err(|e| ClientError::Local(format!("relay: pod IP {ip:?}: {e}")))?;
        let ports = std::env::var(kt_types::env::RELAY_PORT).unwrap_or_default();
        let ports = relay_ports(&ports).map_err(ClientError::Local)?;
        let listener = ports
            .into_iter()
            .find_map(|port| kt_service::cli::listen(std::net::SocketAddr::new(addr, port)).ok())
            .map(Ok)
            .unwrap_or_else(|| {
                tracing::warn!("relay ports ({}) taken; listening on one of the system's choosing, which a NetworkPolicy may block", kt_types::env::RELAY_PORT);
                kt_service::cli::listen(std::net::SocketAddr::new(addr, 0))
            })
            .map_err(|e| ClientError::Local(format!("relay: binding {ip}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| ClientError::Local(format!("relay: {e}")))?;
        let board = Arc::new(Board::default());
        let routes = Router::new()
            .route("/api/v1/trees/{*key}", get(open))
            .route("/api/v1/reads/{lease}/batch", post(batch))
            .route("/api/v1/reads/{lease}/files/{index}", get(range))
            .route("/api/v1/reads/{lease}", delete(release))
            .with_state(board.clone());
        let ready = Ready::default();
        ready.set(true);
        let token =
            Token::new(token).map_err(|e| ClientError::Local(format!("relay token: {e}")))?;
        let key = Token::new(key).map_err(|e| ClientError::Local(format!("relay key: {e}")))?;
        let children = kt_types::auth::Principal {
            role: kt_types::auth::Role::Workload,
            ..kt_types::auth::Principal::admin()
        };
        let auth = kt_service::Auth::from(token).with_grant(key, children);
        let app = kt_service::app(routes, auth, Arc::new(Metrics::new()), ready, 1024);
        let app = kt_service::trace::layer(app, "relay");
        // In a pod whose kt serves TLS, the relay does too, with the pod's
        // certificate (KT_TLS_CERT, KT_TLS_KEY).
        let tls = kt_service::tls::Tls::from_env()
            .map_err(|e| ClientError::Local(format!("relay: {e}")))?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let stop = CancellationToken::new();
        let s = stop.clone();
        let task = tokio::spawn(async move {
            let served =
                kt_service::serve_tls(listener, app, s, Duration::from_secs(1), tls.as_ref()).await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "relay stopped");
            }
        });
        Ok(Relay {
            url: format!("{scheme}://{addr}"),
            board,
            stop,
            task,
        })
    }

    /// Stops serving (readers still waiting are cut off).
    pub async fn stop(mut self) {
        // Readers still waiting are answered first, then the server drains.
        self.board.fail("the getter stopped relaying");
        self.stop.cancel();
        let _ = (&mut self.task).await;
    }
}

impl Drop for Relay {
    /// A getter dropped midway (cancelled) stops relaying at once: its
    /// children see it gone and move on.
    fn drop(&mut self) {
        self.stop.cancel();
        self.board.fail("the getter stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partial(chunk: u64, have: Vec<u64>) -> Avail {
        let file = Arc::new(tempfile::tempfile().unwrap());
        Avail::Partial { file, chunk, have }
    }

    #[test]
    fn what_is_ready_is_the_written_prefix_of_each_chunk() {
        // Chunks of 4 bytes: the first whole, 2 bytes of the second.
        let a = partial(4, vec![4, 2, 0]);
        assert_eq!(a.ready_at(0, 12), 6);
        assert_eq!(a.ready_at(0, 3), 3);
        assert_eq!(a.ready_at(5, 7), 1);
        assert_eq!(a.ready_at(6, 6), 0);
        assert_eq!(a.ready_at(8, 4), 0);
        assert!(a.covers(1, 5) && !a.covers(1, 6) && a.covers(9, 0));
        // A whole chunk past a gap does not count from before the gap.
        let a = partial(4, vec![4, 0, 4]);
        assert_eq!(a.ready_at(0, 12), 4);
        assert_eq!(a.ready_at(8, 4), 4);
        assert_eq!(Avail::At(PathBuf::from("/x")).ready_at(3, 9), 9);
    }

    /// A range is answered piece by piece while its chunk is still being
    /// written: the first bytes go out before the chunk is whole.
    #[tokio::test]
    async fn a_range_goes_out_as_its_pieces_land() {
        const CHUNK: u64 = 1 << 20;
        let b = Arc::new(Board::default());
        let file = tempfile::tempfile().unwrap();
        file.set_len(CHUNK).unwrap();
        let writer = file.try_clone().unwrap();
        b.partial(0, file, CHUNK, &[false]);
        let mut out = Box::pin(b.clone().stream_range(0, 0, CHUNK));

        writer.write_all_at(&[7u8; 100], 0).unwrap();
        b.piece(0, 0, 100);
        let first = tokio::time::timeout(Duration::from_secs(10), out.next())
            .await
            .expect("the first piece goes out before the chunk is whole")
            .unwrap()
            .unwrap();
        assert_eq!(&first[..], &[7u8; 100]);

        writer
            .write_all_at(&vec![9u8; CHUNK as usize - 100], 100)
            .unwrap();
        b.chunk(0, 0);
        let mut rest = Vec::new();
        while let Some(piece) = out.next().await {
            let piece = piece.unwrap();
            assert!(piece.len() as u64 <= PIECE);
            rest.extend_from_slice(&piece);
        }
        assert_eq!(rest.len() as u64, CHUNK - 100);
        assert!(rest.iter().all(|&x| x == 9));
        assert_eq!(b.served(), CHUNK);
    }

    /// A download that fails while a reader waits ends the reader's stream.
    #[tokio::test]
    async fn a_waiting_range_ends_when_the_download_fails() {
        let b = Arc::new(Board::default());
        b.partial(0, tempfile::tempfile().unwrap(), 1024, &[false]);
        let mut out = Box::pin(b.clone().stream_range(0, 0, 1024));
        b.fail("parent gone");
        let e = out.next().await.unwrap().unwrap_err();
        assert!(e.to_string().contains("parent gone"), "{e}");
        assert!(out.next().await.is_none());
    }

    fn bytes(n: usize, x: u8) -> Bytes {
        Bytes::from(vec![x; n])
    }

    #[test]
    fn landed_pieces_are_kept_and_found_by_offset() {
        let mut r = Recent::default();
        // Two buffers of one piece, back to back from offset 100.
        r.keep(1, 100, vec![bytes(10, 1), Bytes::new(), bytes(20, 2)]);
        assert_eq!(r.pieces.len(), 2);
        assert_eq!(r.get(1, 100, 64).unwrap(), bytes(10, 1));
        // Within a buffer; never past its end, nor past `max`.
        assert_eq!(r.get(1, 105, 64).unwrap(), bytes(5, 1));
        assert_eq!(r.get(1, 110, 64).unwrap(), bytes(20, 2));
        assert_eq!(r.get(1, 112, 3).unwrap(), bytes(3, 2));
        // Before, after, another file: not kept.
        assert!(r.get(1, 99, 8).is_none());
        assert!(r.get(1, 130, 8).is_none());
        assert!(r.get(2, 100, 8).is_none());
        r.forget(1);
        assert!(r.get(1, 100, 8).is_none());
        assert_eq!(r.bytes, 0);
    }

    #[test]
    fn only_the_last_landed_bytes_are_kept() {
        let mut r = Recent::default();
        let piece = PIECE as usize;
        let n = RECENT / PIECE;
        for k in 0..n + 2 {
            r.keep(0, k * PIECE, vec![bytes(piece, k as u8)]);
        }
        assert!(r.bytes <= RECENT);
        assert!(r.get(0, 0, 1).is_none() && r.get(0, PIECE, 1).is_none());
        assert_eq!(
            r.get(0, (n + 1) * PIECE, 1).unwrap(),
            bytes(1, (n + 1) as u8)
        );
        assert_eq!(r.get(0, 2 * PIECE, 1).unwrap(), bytes(1, 2));
    }

    /// A piece that landed is served from memory: the same bytes as the
    /// file holds, without reading it (here the file has other bytes, to
    /// tell the two apart); one that is no longer kept is read from the file.
    #[tokio::test]
    async fn a_landed_piece_is_served_from_memory_and_an_old_one_from_the_file() {
        const CHUNK: u64 = 4 * PIECE;
        let b = Arc::new(Board::default());
        let file = tempfile::tempfile().unwrap();
        file.write_all_at(&vec![3u8; CHUNK as usize], 0).unwrap();
        b.partial(0, file, CHUNK, &[false]);
        b.landed(0, 0, 100, (0, vec![bytes(60, 7), bytes(40, 8)]));
        assert_eq!(b.read_piece(0, 0, CHUNK).await.unwrap(), bytes(60, 7));
        assert_eq!(b.read_piece(0, 60, CHUNK).await.unwrap(), bytes(40, 8));
        assert_eq!(b.served(), 100);
        // Landed, then started over: read from the (new) file, never the
        // kept bytes of the file that did not verify.
        b.forget(0);
        let file = tempfile::tempfile().unwrap();
        file.write_all_at(&vec![4u8; CHUNK as usize], 0).unwrap();
        b.partial(0, file, CHUNK, &[true]);
        assert_eq!(b.read_piece(0, 0, 50).await.unwrap(), bytes(50, 4));
    }

    fn board_stalling_after(stall: Duration) -> Arc<Board> {
        Arc::new(Board {
            stall,
            ..Board::default()
        })
    }

    /// A reader whose download keeps changing is not stalled, however
    /// long it waits in all; once the changes stop, it is, about `stall`
    /// after the last one (the one timer of the wait is moved on, not
    /// reset per change).
    #[tokio::test]
    async fn a_waiting_reader_is_stalled_only_once_changes_stop() {
        const STALL_: Duration = Duration::from_secs(1);
        let b = board_stalling_after(STALL_);
        b.partial(0, tempfile::tempfile().unwrap(), 1024, &[false]);
        b.partial(1, tempfile::tempfile().unwrap(), 1024, &[false]);
        let reader = tokio::spawn({
            let b = b.clone();
            async move {
                let started = Instant::now();
                let r = b.read_piece(0, 0, 1024).await;
                (r, started.elapsed())
            }
        });
        // Another file's pieces land for three stall timeouts: progress.
        let mut landed = 0;
        let busy = Instant::now();
        while busy.elapsed() < 3 * STALL_ {
            tokio::time::sleep(STALL_ / 10).await;
            landed += 1;
            b.piece(1, 0, landed);
            assert!(!reader.is_finished(), "stalled while pieces landed");
        }
        let last = Instant::now();
        let (r, waited) = tokio::time::timeout(Duration::from_secs(30), reader)
            .await
            .expect("a reader with no change to see gives up")
            .unwrap();
        let e = r.unwrap_err();
        assert!(e.to_string().contains("no progress"), "{e}");
        assert!(waited >= 3 * STALL_, "{waited:?}");
        assert!(last.elapsed() >= STALL_ - Duration::from_millis(50));
    }

    /// Each frame is timed; pauses of [`GAP`] or more count as waiting.
    #[test]
    fn frames_and_pauses_are_timed() {
        let t = Timings::default();
        assert!(t.first_byte().is_none() && t.last_byte().is_none());
        t.frame();
        let first = t.first_byte().unwrap();
        t.frame();
        assert_eq!(t.waited(), Duration::ZERO);
        std::thread::sleep(GAP + Duration::from_millis(10));
        t.frame();
        assert!(t.waited() >= GAP, "{:?}", t.waited());
        assert_eq!(t.first_byte(), Some(first));
        assert!(t.last_byte().unwrap() - first >= GAP);
        t.piece(Duration::from_millis(3), Duration::from_millis(5));
        t.piece(Duration::from_millis(3), Duration::from_millis(5));
        assert_eq!(t.hashing(), Duration::from_millis(6));
        assert_eq!(t.writing(), Duration::from_millis(10));
    }

    #[test]
    fn relay_port_specs() {
        assert_eq!(relay_ports("").unwrap(), (8091..=8099).collect::<Vec<_>>());
        assert_eq!(relay_ports("9000").unwrap(), vec![9000]);
        assert_eq!(relay_ports("9000-9002").unwrap(), vec![9000, 9001, 9002]);
        assert!(relay_ports("0").unwrap().is_empty());
        assert!(relay_ports("9002-9000").is_err());
        assert!(relay_ports("http").is_err());
    }
}
