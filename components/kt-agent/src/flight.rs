//! Arrow Flight on the node agent (cargo feature `flight`, `--flight-addr`):
//! `DoGet` streams one rank's share of the Parquet and Arrow IPC files
//! below a prefix as record batches, so a plain `pyarrow.flight` client —
//! the way the reference data cache's training nodes read — gets its share
//! without the kt package.
//!
//! The ticket is [`ShareTicket`]'s JSON (`prefix`, `rank`, `world`, `epoch`,
//! `shuffle`). The share is [`kt_client`]'s ([`Client::stream_share`], the
//! same listing and [`kt_types::shard`] split as `kt get --shard` and
//! `kt.Dataset`), fetched ahead within [`FlightConfig::budget`] into a
//! temporary directory (`share-*`) below `--flight-dir` and decoded one
//! file at a time, in reading order; files named `_*` or `.*` (`_SUCCESS`,
//! `_metadata`, as pyarrow's datasets skip them) are passed over.
//!
//! Invariants:
//! - an agent with a certificate (`--tls-cert`) serves Flight over TLS
//!   only, with that certificate and ALPN `h2` ([`bind`]): the caller's
//!   token never crosses the network in the clear there.
//! - every call reads with the caller's bearer token (`authorization:
//!   Bearer <token>`), never the agent's: the metadata server and the
//!   sources decide what it may read, as for any get. A listing shows a
//!   token only the services it reads, so a prefix of another service is
//!   answered `NotFound` just as `kt get PREFIX/` is (nobody learns of
//!   another service's keys here either); a token nobody knows is
//!   `Unauthenticated`, a role that may not read `PermissionDenied`.
//! - memory: a call holds at most [`CALL_MEMORY`]: one decoded batch at a
//!   time per file (at most [`MAX_BATCH_BYTES`]) plus [`QUEUED`] waiting
//!   for the client and one being encoded, what the file's reader holds
//!   (at most [`MAX_READER_BYTES`]) and its decoded footer (at most
//!   [`FOOTER_MEMORY`]). Every bound is checked from the file's headers
//!   before the bytes they describe are read or decompressed; a file over
//!   one is refused (`ResourceExhausted`, naming the file and the cap). A
//!   Parquet file ([`pages`]): a page over [`MAX_BATCH_BYTES`] compressed
//!   or uncompressed, a row that may decode to more, or a row group whose
//!   largest pages and dictionaries (the reader holds one page of every
//!   column at once) are over [`MAX_READER_BYTES`]; the rows per batch are
//!   chosen so that a batch's worst case (every dictionary index at the
//!   longest value) stays within [`MAX_BATCH_BYTES`]. An Arrow IPC file or
//!   stream ([`ipc`]): a record batch whose body, or what its compressed
//!   buffers claim to decompress to, is over [`MAX_BATCH_BYTES`] (an IPC
//!   batch is passed on as written: write smaller ones), or dictionaries
//!   over [`MAX_READER_BYTES`] together. A footer or message metadata over
//!   [`MAX_FOOTER`] is refused before decoding. The agent's memory limit
//!   must hold [`CALL_MEMORY`] times [`FlightConfig::max_calls`] above its
//!   own needs (the flight kustomize component sets it; policy.py checks).
//! - local disk: the call's budget, in a `share-*` directory below
//!   [`FlightConfig::dir`], removed when the call ends, however it ends; a
//!   data file larger than the budget is refused (`ResourceExhausted`,
//!   naming it). The budget is per call, so the agent's disk use is up to
//!   [`FlightConfig::max_calls`] times it: the agent does not start unless
//!   the directory's free space holds that. That free space is the
//!   filesystem's (for an emptyDir, the node's disk, not its sizeLimit), so
//!   in a pod (`KT_POD_IP`) `--flight-dir` must be given: a volume of the
//!   calls' own, never the agent's small state volume ([`scratch_dir`]).
//!   The agent never removes that directory, nor anything in it but the
//!   `share-*` entries calls leave (at start, what a killed agent left).
//! - the caller's token is checked first (one small metadata call); then
//!   the call takes a slot of its token ([`FlightConfig::per_token`], keyed
//!   by the token's hash) and one of the agent's
//!   ([`FlightConfig::max_calls`]) before the share is listed, so no call
//!   over the limits lists anything; a listing of more than
//!   [`FlightConfig::max_files`] files is refused. A client that goes away
//!   (or reads nothing for [`FlightConfig::idle`]), or a call that lasts
//!   [`FlightConfig::max_duration`], ends the call's downloads and decoding
//!   and frees its slots. Marker files are never fetched: the stream
//!   passes them over ([`StreamOptions::skip`]), keeping the split.
//! - every file of a share has the first one's columns (names and types, in
//!   order); a file that differs ends the stream with `FailedPrecondition`
//!   naming both. Schema metadata (pandas', Parquet's) is dropped.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow_array::RecordBatch;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use arrow_schema::{ArrowError, Schema, SchemaRef};
use futures::{Stream, StreamExt};
use kt_client::stream::{StreamOptions, StreamedFile};
use kt_client::{Client, ClientConfig, ClientError};
use kt_types::ErrorCode;
use kt_types::shard::ShareTicket;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::{Request, Response, Status, Streaming};

use crate::config::FlightConfig;

mod ipc;
mod pages;

/// Decoded batches waiting for a slow client, per call.
pub const QUEUED: usize = 2;
/// Rows per record batch decoded from Parquet, at most (fewer when a batch
/// of them may decode to more than [`MAX_BATCH_BYTES`]; an IPC file's
/// batches are passed on as written).
pub const PARQUET_BATCH_ROWS: usize = 8192;
/// The most bytes a Parquet page may claim (compressed or not), a decoded
/// Parquet batch may take in the worst case its file allows, and an Arrow
/// IPC record batch may take as read and as decompressed.
pub const MAX_BATCH_BYTES: u64 = 32 << 20;

/// What one file's reader may hold besides the batch it decodes: a
/// Parquet row group's pages (one of every column at once and every
/// column's dictionary, decoded, and the page being read), an Arrow IPC
/// file's dictionaries.
pub const MAX_READER_BYTES: u64 = 128 << 20;
/// The most a Parquet file's footer may take decoded (it is held for the
/// whole file; what [`MAX_FOOTER`] encoded bytes decode to is checked).
pub const FOOTER_MEMORY: u64 = 64 << 20;
/// The most memory one Flight call holds: [`QUEUED`] batches waiting for
/// the client, one the decoder is handing over and one being encoded (each
/// at most [`MAX_BATCH_BYTES`]), what the file's reader holds
/// ([`MAX_READER_BYTES`]) and its footer ([`FOOTER_MEMORY`]). An agent's
/// memory limit holds this times `--flight-max-calls` above its own
/// needs: testbed/k8s/policy.py reads this line (`<< 20`, in MiB).
pub const CALL_MEMORY: u64 = 320 << 20;
const _: () = assert!(
    (QUEUED as u64 + 2) * MAX_BATCH_BYTES + MAX_READER_BYTES + FOOTER_MEMORY <= CALL_MEMORY
);
/// What a call's directory below `--flight-dir` is named after; nothing
/// else there is the agent's.
const SHARE_PREFIX: &str = "share-";

/// Idle connections are probed this often (TCP and HTTP/2 pings).
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);
/// An HTTP/2 ping unanswered this long closes the connection.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The Flight service of one agent.
#[derive(Debug, Clone)]
pub struct Shares {
    metadata_url: String,
    /// Per-call temporary directories go here (the agent's own).
    scratch: PathBuf,
    budget: u64,
    calls: Arc<Semaphore>,
    max_calls: usize,
    /// Calls per token (by its hash) now.
    tokens: Arc<Mutex<HashMap<blake3::Hash, usize>>>,
    per_token: usize,
    max_files: usize,
    max_duration: Duration,
    /// How long a decoded batch may wait for the client to take it.
    idle: Duration,
}

/// A call's hold on its token's count ([`Shares::tokens`]).
#[derive(Debug)]
struct TokenSlot {
    tokens: Arc<Mutex<HashMap<blake3::Hash, usize>>>,
    hash: blake3::Hash,
}

impl Drop for TokenSlot {
    fn drop(&mut self) {
        let mut tokens = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = tokens.get_mut(&self.hash) {
            *n -= 1;
            if *n == 0 {
                tokens.remove(&self.hash);
            }
        }
    }
}

/// What a call holds until it ends: its token's slot and the agent's.
#[derive(Debug)]
struct Slots {
    _token: TokenSlot,
    _call: OwnedSemaphorePermit,
}

impl Shares {
    /// The service: shares listed at `metadata_url`, fetched below
    /// `scratch` (made if missing; the `share-*` entries a killed agent's
    /// calls left are removed now, and nothing else: it may be a volume's
    /// mount point, or hold what is not the agent's). Refused when the
    /// free space there cannot hold `cfg.budget` for each of
    /// `cfg.max_calls` calls.
    pub fn new(
        metadata_url: &str,
        scratch: PathBuf,
        cfg: &FlightConfig,
    ) -> Result<Shares, FlightSetupError> {
        let io = |source: std::io::Error| FlightSetupError::Io {
            dir: scratch.clone(),
            source,
        };
        std::fs::create_dir_all(&scratch).map_err(io)?;
        clear_leftovers(&scratch).map_err(io)?;
        let max_calls = cfg.max_calls.max(1);
        let free = free_bytes(&scratch).map_err(io)?;
        check_space(&scratch, free, cfg.budget, max_calls)?;
        Ok(Shares {
            metadata_url: metadata_url.to_owned(),
            scratch,
            budget: cfg.budget,
            calls: Arc::new(Semaphore::new(max_calls)),
            max_calls,
            tokens: Arc::default(),
            per_token: cfg.per_token.max(1),
            max_files: cfg.max_files.max(1),
            max_duration: cfg.max_duration,
            idle: cfg.idle,
        })
    }

    /// A slot of the caller's token, then one of the agent's.
    fn take_slots(&self, token: &str) -> Result<Slots, Status> {
        let hash = blake3::hash(token.as_bytes());
        {
            let mut tokens = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
            let n = tokens.entry(hash).or_insert(0);
            if *n >= self.per_token {
                return Err(Status::resource_exhausted(format!(
                    "your token already holds {} Flight calls on this agent, the most one token may (--flight-max-calls-per-token); end one or try again shortly",
                    self.per_token
                )));
            }
            *n += 1;
        }
        let token = TokenSlot {
            tokens: self.tokens.clone(),
            hash,
        };
        let call = self.calls.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "this agent serves {} Flight calls at once (--flight-max-calls); try again shortly",
                self.max_calls
            ))
        })?;
        Ok(Slots {
            _token: token,
            _call: call,
        })
    }

    /// A client that reads as the caller: its token, no scan cache, no
    /// copies handed to an agent (a streamed file is deleted once decoded).
    fn client_for(&self, token: &str) -> Result<Client, Status> {
        let mut cfg = ClientConfig::new(&self.metadata_url, token);
        cfg.cache_dir = None;
        cfg.serve_copies = false;
        Client::new(cfg).map_err(|e| Status::internal(format!("a client for the call: {e}")))
    }

    async fn share(&self, request: Request<Ticket>) -> Result<BoxStream<FlightData>, Status> {
        let token = bearer(request.metadata())?;
        let (prefix, spec) = ShareTicket::parse(&request.get_ref().ticket)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let client = self.client_for(token)?;
        // The token, checked with one small call before anything is held
        // for it (a token nobody knows takes no slot).
        client.store_url().await.map_err(|e| status(&e))?;
        let slots = self.take_slots(token)?;
        let deadline = Instant::now() + self.max_duration;
        let dir = tempfile::Builder::new()
            .prefix(SHARE_PREFIX)
            .tempdir_in(&self.scratch)
            .map_err(|e| Status::internal(format!("a directory for the share: {e}")))?;
        let mut opts = StreamOptions::new(spec, self.budget);
        opts.dir = Some(dir.path().to_owned());
        opts.skip = Some(skipped);
        opts.max_files = self.max_files;
        let files = client
            .stream_share(&prefix, opts)
            .await
            .map_err(|e| match &e {
                ClientError::Local(m) if m.starts_with(kt_client::stream::TOO_MANY_FILES) => {
                    Status::resource_exhausted(format!(
                        "{m}: this agent's Flight calls list at most {} (--flight-max-files); ask for a narrower prefix",
                        self.max_files
                    ))
                }
                _ => status(&e),
            })?;
        if let Some(f) = files
            .share()
            .iter()
            .find(|f| !skipped(&f.path) && f.size > self.budget)
        {
            return Err(Status::resource_exhausted(format!(
                "{} ({} bytes) is larger than this agent's Flight budget of {} bytes per call (--flight-budget)",
                f.path, f.size, self.budget
            )));
        }
        tracing::info!(%prefix, shard = %spec.shard, epoch = spec.epoch, shuffle = spec.shuffle,
            files = files.share().len(), "flight: streaming a share");
        let (tx, mut rx) = mpsc::channel(QUEUED);
        let limits = Limits {
            idle: self.idle,
            deadline,
            max_duration: self.max_duration,
        };
        tokio::spawn(produce(files, tx, dir, slots, limits));
        // The schema comes first (or the error that ended the share before
        // any batch): answered as the call's status.
        let schema = match rx.recv().await {
            Some(Ok(Decoded::Schema(s))) => s,
            Some(Ok(Decoded::Batch(_) | Decoded::End)) => {
                return Err(Status::internal("a batch came before the schema"));
            }
            Some(Err(e)) => return Err(e),
            None => return Err(Status::internal("the share ended before its schema")),
        };
        // A stream that stops without `End` was cut off by the agent (the
        // client took nothing for `idle`): said so, never a silent short
        // share.
        let idle = self.idle;
        let batches = futures::stream::unfold(Some(rx), move |rx| async move {
            let mut rx = rx?;
            let item = match rx.recv().await {
                Some(Ok(Decoded::Batch(b))) => Ok(b),
                Some(Ok(Decoded::End)) => return None,
                Some(Ok(Decoded::Schema(_))) => Err(FlightError::protocol("a second schema")),
                Some(Err(e)) => return Some((Err(FlightError::Tonic(Box::new(e))), None)),
                None => {
                    let e = Status::deadline_exceeded(format!(
                        "the agent ended this call: its client took no data for {idle:?}"
                    ));
                    return Some((Err(FlightError::Tonic(Box::new(e))), None));
                }
            };
            Some((item, Some(rx)))
        });
        let data = FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .build(batches)
            .map(|d| d.map_err(Status::from));
        Ok(Box::pin(data))
    }
}

/// Removes the `share-*` entries of `dir` (what calls of an agent that
/// was killed left), and nothing else: a link is removed as a link.
fn clear_leftovers(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if !entry
            .file_name()
            .as_encoded_bytes()
            .starts_with(SHARE_PREFIX.as_bytes())
        {
            tracing::info!(path = %path.display(), "flight: --flight-dir holds what this agent did not make; left alone");
            continue;
        }
        let removed = if entry.file_type()?.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match removed {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {
                tracing::info!(path = %path.display(), "flight: removed what an earlier call left")
            }
        }
    }
    Ok(())
}

/// Where calls fetch their files: `--flight-dir`; outside a pod, by
/// default `flight` below the state directory. In a pod (`in_pod`: the
/// agent knows its pod's IP) it must be given: the start's free-space
/// check sees the filesystem, which for an emptyDir is the node's disk,
/// not its sizeLimit, and the agent's state volume is small (the kubelet
/// evicts the whole pod when a call outgrows it).
pub fn scratch_dir(
    cfg: &FlightConfig,
    state_dir: &Path,
    in_pod: bool,
) -> Result<PathBuf, FlightSetupError> {
    match &cfg.dir {
        Some(dir) => Ok(dir.clone()),
        None if in_pod => Err(FlightSetupError::NoDir),
        None => Ok(state_dir.join("flight")),
    }
}

/// Why the Flight server cannot start.
#[derive(Debug, thiserror::Error)]
pub enum FlightSetupError {
    #[error(
        "in a pod ({pod_ip} is set) Flight needs --flight-dir ({dir}): a volume of the calls' own whose size holds --flight-budget times --flight-max-calls (the flight kustomize component mounts one, kt-flight). The free space the agent checks at start is the filesystem's (for an emptyDir, the node's disk, not its sizeLimit), and below the agent's state volume a call would outgrow it and get the pod evicted",
        pod_ip = kt_types::env::POD_IP,
        dir = kt_types::env::FLIGHT_DIR
    )]
    NoDir,
    #[error("the Flight directory {}: {source}", dir.display())]
    Io {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the Flight directory {dir} has {free} bytes free, less than --flight-budget ({budget} bytes) times --flight-max-calls ({calls}) = {need} bytes that Flight calls may hold there: give --flight-dir a volume that large (the flight kustomize component sizes one) or lower the two"
    )]
    NoSpace {
        dir: String,
        free: u64,
        budget: u64,
        calls: usize,
        need: u64,
    },
}

/// Bytes free to the agent below `dir`.
fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    crate::datasets::fs_space(dir).map(|(_, available)| available)
}

/// Refuses a directory whose `free` bytes cannot hold `budget` for each of
/// `calls` calls.
fn check_space(dir: &Path, free: u64, budget: u64, calls: usize) -> Result<(), FlightSetupError> {
    let need = budget.saturating_mul(calls as u64);
    if free < need {
        return Err(FlightSetupError::NoSpace {
            dir: dir.display().to_string(),
            free,
            budget,
            calls,
            need,
        });
    }
    Ok(())
}

/// The Flight port: plaintext gRPC, or TLS with the agent's certificate.
#[derive(Debug)]
pub enum Listener {
    /// No certificate: `grpc://`.
    Plain(TcpListener),
    /// `--tls-cert`: `grpc+tls://`, handshakes beside the accept loop.
    Tls(kt_service::tls::TlsListener),
}

impl Listener {
    /// The bound address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        match self {
            Listener::Plain(l) => l.local_addr(),
            Listener::Tls(l) => axum::serve::Listener::local_addr(l),
        }
    }
}

/// Serves `shares` on `listener` until `shutdown` is cancelled.
pub async fn serve(
    listener: Listener,
    shares: Shares,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    // A connection's streams beyond the calls the agent serves would only
    // be refused: HTTP/2 refuses them first.
    let streams = u32::try_from(shares.max_calls).unwrap_or(u32::MAX);
    let router = tonic::transport::Server::builder()
        // Until a DoGet's answer (the listing and the share's first file);
        // its stream is bounded by the idle timeout per batch.
        .timeout(shares.idle)
        .concurrency_limit_per_connection(shares.max_calls)
        .max_concurrent_streams(Some(streams))
        .http2_keepalive_interval(Some(TCP_KEEPALIVE))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .add_service(FlightServiceServer::new(shares));
    let stop = shutdown.cancelled_owned();
    match listener {
        Listener::Plain(listener) => {
            let incoming = tonic::transport::server::TcpIncoming::from(listener)
                .with_nodelay(Some(true))
                .with_keepalive(Some(TCP_KEEPALIVE));
            router.serve_with_incoming_shutdown(incoming, stop).await
        }
        Listener::Tls(accepted) => {
            let local = axum::serve::Listener::local_addr(&accepted).ok();
            let incoming = futures::stream::unfold(accepted, move |mut l| async move {
                let (io, peer) = axum::serve::Listener::accept(&mut l).await;
                // Small frames (headers, the schema) go out at once. No TCP
                // keepalive here: the HTTP/2 pings above find a dead peer.
                let _ = io.get_ref().0.set_nodelay(true);
                let info = TcpConnectInfo {
                    local_addr: local,
                    remote_addr: Some(peer),
                };
                Some((Ok::<_, std::io::Error>(TlsConn { io, info }), l))
            });
            router.serve_with_incoming_shutdown(incoming, stop).await
        }
    }
}

/// An accepted TLS connection, with the addresses tonic puts in each
/// request (its own rustls `Connected` is behind a feature kt leaves off).
struct TlsConn {
    io: <kt_service::tls::TlsListener as axum::serve::Listener>::Io,
    info: TcpConnectInfo,
}

impl Connected for TlsConn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.info.clone()
    }
}

impl tokio::io::AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Binds `addr` (dual-stack for `0.0.0.0`, as the agent's HTTP port);
/// with `tls`, its connections are TLS with that certificate offering ALPN
/// `h2` (gRPC clients refuse a server without it).
pub fn bind(addr: SocketAddr, tls: Option<&kt_service::tls::Tls>) -> std::io::Result<Listener> {
    let tcp = kt_service::cli::listen(addr)?;
    Ok(match tls {
        None => Listener::Plain(tcp),
        Some(tls) => Listener::Tls(kt_service::tls::TlsListener::new(tcp, &tls.h2())?),
    })
}

/// The caller's bearer token.
fn bearer(meta: &tonic::metadata::MetadataMap) -> Result<&str, Status> {
    let missing = || {
        Status::unauthenticated(
            "no bearer token: send the header `authorization: Bearer <token>` (your kt token)",
        )
    };
    let value = meta.get("authorization").ok_or_else(missing)?;
    let value = value.to_str().map_err(|_| missing())?;
    let token = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or_else(missing)?;
    Ok(token)
}

/// The gRPC status of a failed kt call.
fn status(e: &ClientError) -> Status {
    let message = e.to_string();
    if e.timed_out_in().is_some() {
        return Status::deadline_exceeded(message);
    }
    match e.code() {
        Some(ErrorCode::Unauthorized) => Status::unauthenticated(message),
        Some(ErrorCode::Forbidden) => Status::permission_denied(message),
        Some(ErrorCode::NotFound) => Status::not_found(message),
        Some(ErrorCode::InvalidKey | ErrorCode::InvalidRequest | ErrorCode::InvalidManifest) => {
            Status::invalid_argument(message)
        }
        Some(ErrorCode::HashMismatch | ErrorCode::Truncated) => Status::data_loss(message),
        Some(ErrorCode::NoStore | ErrorCode::NoSource | ErrorCode::Unavailable) => {
            Status::unavailable(message)
        }
        Some(ErrorCode::InsufficientStorage) => Status::resource_exhausted(message),
        _ => Status::internal(message),
    }
}

/// What the decoder hands the encoder.
#[derive(Debug)]
enum Decoded {
    /// The share's schema (first, once).
    Schema(SchemaRef),
    Batch(RecordBatch),
    /// The share is complete (last, once).
    End,
}

type Sender = mpsc::Sender<Result<Decoded, Status>>;

/// How long a call may wait and last.
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// For the client to take a message.
    idle: Duration,
    /// When the call ends, however fast it reads.
    deadline: Instant,
    /// `--flight-max-duration`, for the message that says so.
    max_duration: Duration,
}

impl Limits {
    /// The status of a call past its deadline.
    fn expired(&self) -> Status {
        Status::deadline_exceeded(format!(
            "the agent ended this call: it lasted {:?}, the most a Flight call may (--flight-max-duration); resume from the files you have with a new call",
            self.max_duration
        ))
    }
}

/// The decoder's way to the client: a message it does not take within
/// `idle` ends the call as if it had gone away.
struct Out {
    tx: Sender,
    limits: Limits,
    rt: tokio::runtime::Handle,
}

impl Out {
    /// `Ok(false)`: the client is gone or idle; `Err`: the call is past its
    /// deadline.
    fn send(&self, m: Decoded) -> Result<bool, Status> {
        let wait = self.limits.idle.min(
            self.limits
                .deadline
                .saturating_duration_since(Instant::now()),
        );
        let sent = self.rt.block_on(self.tx.send_timeout(Ok(m), wait));
        if let Err(mpsc::error::SendTimeoutError::Timeout(_)) = &sent {
            if Instant::now() >= self.limits.deadline {
                return Err(self.limits.expired());
            }
            tracing::info!(idle = ?self.limits.idle, "flight: a client read nothing for too long; ending its call");
        }
        Ok(sent.is_ok())
    }
}

/// Decodes the share's files in order into `tx`; the first message is the
/// schema, the last [`Decoded::End`] (or the error that ended the share).
/// Ends at the first error or when the client is gone or idle. The call's
/// directory is removed (and its permit returned) before the last message
/// is sent, so a client that saw the end of its stream leaves nothing.
async fn produce(
    files: kt_client::stream::ShareStream,
    tx: Sender,
    dir: tempfile::TempDir,
    slots: Slots,
    limits: Limits,
) {
    let idle = limits.idle;
    let ending = relay(files, &tx, limits).await;
    if let Err(e) = dir.close() {
        tracing::warn!(error = %e, "removing a Flight call's directory");
    }
    drop(slots);
    let last = match ending {
        Ending::Gone => return,
        Ending::Failed(e) => vec![Err(e)],
        // No data file at all (an empty share): no columns.
        Ending::Done { empty: true } => vec![
            Ok(Decoded::Schema(Arc::new(Schema::empty()))),
            Ok(Decoded::End),
        ],
        Ending::Done { empty: false } => vec![Ok(Decoded::End)],
    };
    for m in last {
        if tx.send_timeout(m, idle).await.is_err() {
            return;
        }
    }
}

/// How [`relay`] ended.
#[derive(Debug)]
enum Ending {
    /// The client went away or took nothing for the idle timeout.
    Gone,
    Failed(Status),
    /// Every file was sent; `empty`: there was no data file.
    Done {
        empty: bool,
    },
}

/// [`produce`]'s work.
async fn relay(mut files: kt_client::stream::ShareStream, tx: &Sender, limits: Limits) -> Ending {
    let mut first: Option<First> = None;
    loop {
        // A client that went away stops the downloads at once.
        let got = tokio::select! {
            _ = tx.closed() => return Ending::Gone,
            _ = tokio::time::sleep_until(limits.deadline) => return Ending::Failed(limits.expired()),
            got = files.next() => got,
        };
        let Some(got) = got else { break };
        let file = match got {
            Ok(f) => f,
            Err(e) => return Ending::Failed(status(&e)),
        };
        let out = Out {
            tx: tx.clone(),
            limits,
            rt: tokio::runtime::Handle::current(),
        };
        let known = first.clone();
        // The file is deleted (and its bytes given back to the budget) when
        // the decoder drops it.
        let decoded = kt_sync::task::spawn(move || decode(file, known, &out)).await;
        match decoded {
            Ok(Ok(Some(f))) => first = Some(f),
            Ok(Ok(None)) => return Ending::Gone,
            Ok(Err(e)) => return Ending::Failed(e),
            Err(e) => return Ending::Failed(Status::internal(format!("decoding failed: {}", e.0))),
        }
    }
    Ending::Done {
        empty: first.is_none(),
    }
}

/// Data files only: `_SUCCESS`, `_metadata`, `.crc`… (any path segment
/// starting with `_` or `.`) are not, as pyarrow's datasets see it.
fn skipped(path: &str) -> bool {
    path.split('/')
        .any(|s| s.starts_with('_') || s.starts_with('.'))
}

/// The file formats a share may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Parquet,
    IpcFile,
    IpcStream,
}

/// By the file's first bytes.
fn sniff(path: &Path) -> std::io::Result<Option<Format>> {
    use std::io::Read;
    let mut head = [0u8; 8];
    let mut f = std::fs::File::open(path)?;
    let mut n = 0;
    while n < head.len() {
        match f.read(&mut head[n..])? {
            0 => break,
            k => n += k,
        }
    }
    let head = &head[..n];
    Ok(if head.starts_with(b"PAR1") {
        Some(Format::Parquet)
    } else if head.starts_with(b"ARROW1") {
        Some(Format::IpcFile)
    } else if head.starts_with(&[0xff; 4]) {
        Some(Format::IpcStream)
    } else {
        None
    })
}

/// Largest Parquet or Arrow IPC file footer (the metadata, read into
/// memory whole before any batch), or IPC message metadata, a call
/// decodes.
pub const MAX_FOOTER: u64 = 8 << 20;

/// Refuses a file whose footer length (the 4 bytes before its closing
/// magic) is over [`MAX_FOOTER`]: what its reader would allocate first.
fn check_footer(path: &Path, format: Format) -> std::io::Result<Result<(), String>> {
    use std::io::{Read, Seek, SeekFrom};
    let magic = match format {
        Format::Parquet => 4,
        Format::IpcFile => 6,
        Format::IpcStream => return Ok(Ok(())),
    };
    let mut f = std::fs::File::open(path)?;
    let size = f.metadata()?.len();
    if size < 4 + magic {
        return Ok(Ok(())); // the reader says what is wrong
    }
    f.seek(SeekFrom::Start(size - 4 - magic))?;
    let mut len = [0u8; 4];
    f.read_exact(&mut len)?;
    let len = u64::from(u32::from_le_bytes(len));
    Ok(if len > MAX_FOOTER {
        Err(format!(
            "its footer claims {len} bytes, over the {MAX_FOOTER} bytes a Flight call decodes"
        ))
    } else {
        Ok(())
    })
}

/// What an Arrow IPC file's messages are held to ([`ipc`]).
const IPC_CAPS: ipc::Caps = ipc::Caps {
    batch: MAX_BATCH_BYTES,
    dictionaries: MAX_READER_BYTES,
    metadata: MAX_FOOTER,
};

/// The status of an IPC file [`ipc`]'s walk refused.
fn check_ipc(name: &str, walked: Result<(), ipc::Problem>) -> Result<(), Status> {
    match walked {
        Ok(()) => Ok(()),
        Err(ipc::Problem::Over(why)) => Err(Status::resource_exhausted(format!("{name}: {why}"))),
        Err(ipc::Problem::Malformed(why)) => {
            Err(Status::invalid_argument(format!("{name}: {why}")))
        }
        Err(ipc::Problem::Io(e)) => Err(Status::internal(format!("{name}: {e}"))),
    }
}

/// The share's schema and the file it came from.
type First = (SchemaRef, String);

/// Decodes one file into `tx` (blocking): the schema first when `first` is
/// `None` (the share's first data file), then its batches, each under the
/// share's schema. `Ok(None)`: the client went away. The file is deleted
/// when this returns.
fn decode(file: StreamedFile, first: Option<First>, tx: &Out) -> Result<Option<First>, Status> {
    let name = file.file.path.as_str();
    let path = file.path();
    let io = |e: std::io::Error| Status::internal(format!("{name}: {e}"));
    let bad = |e: &dyn std::fmt::Display| Status::invalid_argument(format!("{name}: {e}"));
    let format = sniff(path).map_err(io)?.ok_or_else(|| {
        Status::invalid_argument(format!(
            "{name} is neither Parquet nor Arrow IPC (a file or a stream): a share streams those only"
        ))
    })?;
    if let Err(why) = check_footer(path, format).map_err(io)? {
        return Err(Status::resource_exhausted(format!("{name}: {why}")));
    }
    let open = || std::fs::File::open(path).map_err(io);
    type Batches = Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>>>;
    let (own, batches): (SchemaRef, Batches) = match format {
        Format::Parquet => {
            let f = open()?;
            let b = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
                f.try_clone().map_err(io)?,
            )
            .map_err(|e| bad(&e))?;
            let footer = b.metadata().memory_size() as u64;
            if footer > FOOTER_MEMORY {
                return Err(Status::resource_exhausted(format!(
                    "{name}: its footer takes {footer} bytes decoded, over the {FOOTER_MEMORY} bytes a Flight call holds for it"
                )));
            }
            // Bounded before a page is decompressed (see `pages`).
            let rows = pages::batch_rows(
                &f,
                b.metadata(),
                MAX_BATCH_BYTES,
                MAX_READER_BYTES,
                PARQUET_BATCH_ROWS,
            )
            .map_err(|why| Status::resource_exhausted(format!("{name}: {why}")))?;
            let schema = b.schema().clone();
            let reader = b.with_batch_size(rows).build().map_err(|e| bad(&e))?;
            (schema, Box::new(reader))
        }
        Format::IpcFile => {
            let f = open()?;
            check_ipc(name, ipc::check_file(&f, IPC_CAPS))?;
            let r = arrow_ipc::reader::FileReader::try_new(f, None).map_err(|e| bad(&e))?;
            (r.schema(), Box::new(r))
        }
        Format::IpcStream => {
            let f = open()?;
            check_ipc(name, ipc::check_stream(&f, IPC_CAPS))?;
            let r = arrow_ipc::reader::StreamReader::try_new(std::io::BufReader::new(f), None)
                .map_err(|e| bad(&e))?;
            (r.schema(), Box::new(r))
        }
    };
    let (schema, first_name) = match first {
        Some((schema, first_name)) => {
            if let Some(why) = mismatch(&schema, &own) {
                return Err(Status::failed_precondition(format!(
                    "{name} does not have the columns of {first_name}, the share's first file: {why}; every file of a share must"
                )));
            }
            (schema, first_name)
        }
        None => {
            let schema = Arc::new(Schema::new(own.fields().clone()));
            if !tx.send(Decoded::Schema(schema.clone()))? {
                return Ok(None);
            }
            (schema, name.to_owned())
        }
    };
    for batch in batches {
        let batch = batch.map_err(|e| bad(&e))?;
        let batch = RecordBatch::try_new(schema.clone(), batch.columns().to_vec())
            .map_err(|e| Status::failed_precondition(format!("{name}: {e}")))?;
        if !tx.send(Decoded::Batch(batch))? {
            return Ok(None);
        }
    }
    drop(file);
    Ok(Some((schema, first_name)))
}

/// Why `other`'s columns are not `share`'s (names and types, in order;
/// metadata aside), if they are not.
fn mismatch(share: &Schema, other: &Schema) -> Option<String> {
    let show = |s: &Schema| {
        s.fields()
            .iter()
            .map(|f| format!("{}: {}", f.name(), f.data_type()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let same = share.fields().len() == other.fields().len()
        && share
            .fields()
            .iter()
            .zip(other.fields().iter())
            .all(|(a, b)| a.name() == b.name() && a.data_type() == b.data_type());
    (!same).then(|| format!("[{}] against [{}]", show(other), show(share)))
}

#[tonic::async_trait]
impl FlightService for Shares {
    type HandshakeStream = BoxStream<HandshakeResponse>;
    type ListFlightsStream = BoxStream<FlightInfo>;
    type DoGetStream = BoxStream<FlightData>;
    type DoPutStream = BoxStream<PutResult>;
    type DoExchangeStream = BoxStream<FlightData>;
    type DoActionStream = BoxStream<arrow_flight::Result>;
    type ListActionsStream = BoxStream<ActionType>;

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        self.share(request).await.map(Response::new)
    }

    async fn handshake(
        &self,
        _: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        Err(not_served(
            "Handshake (send your kt token as `authorization: Bearer <token>`)",
        ))
    }

    async fn list_flights(
        &self,
        _: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        Err(not_served("ListFlights"))
    }

    async fn get_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        Err(not_served("GetFlightInfo"))
    }

    async fn poll_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        Err(not_served("PollFlightInfo"))
    }

    async fn get_schema(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        Err(not_served("GetSchema"))
    }

    async fn do_put(
        &self,
        _: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        Err(not_served("DoPut (put data with kt put)"))
    }

    async fn do_exchange(
        &self,
        _: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        Err(not_served("DoExchange"))
    }

    async fn do_action(
        &self,
        _: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        Err(not_served("DoAction"))
    }

    async fn list_actions(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        Err(not_served("ListActions"))
    }
}

/// The answer to every call but DoGet.
fn not_served(what: &str) -> Status {
    Status::unimplemented(format!(
        "a kt agent serves Flight DoGet only, with a ticket {{\"prefix\":..,\"rank\":..,\"world\":..}}; not {what}"
    ))
}

#[cfg(test)]
mod tests {
    use arrow_schema::{DataType, Field};

    use super::*;

    #[test]
    fn markers_and_hidden_files_are_no_data() {
        for p in [
            "_SUCCESS",
            "part-b/_metadata",
            ".crc/x.parquet",
            "a/.hidden",
        ] {
            assert!(skipped(p), "{p}");
        }
        for p in ["shard-00.parquet", "part-b/x_y.arrow", "a.b/c"] {
            assert!(!skipped(p), "{p}");
        }
    }

    #[test]
    fn formats_are_told_by_their_first_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let cases: [(&[u8], Option<Format>); 5] = [
            (b"PAR1\x15\x04", Some(Format::Parquet)),
            (b"ARROW1\0\0", Some(Format::IpcFile)),
            (b"\xff\xff\xff\xff\x10\0\0\0", Some(Format::IpcStream)),
            (b"PAR", None),
            (b"a,b\n1,2\n", None),
        ];
        for (i, (head, want)) in cases.into_iter().enumerate() {
            let p = dir.path().join(i.to_string());
            std::fs::write(&p, head).unwrap();
            assert_eq!(sniff(&p).unwrap(), want, "{head:?}");
        }
        assert!(sniff(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn footers_over_the_limit_are_refused_before_decoding() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let file = |len: u32, magic: &[u8]| {
            let mut b = magic.to_vec();
            b.extend_from_slice(&[0; 16]);
            b.extend_from_slice(&len.to_le_bytes());
            b.extend_from_slice(magic);
            std::fs::write(&p, b).unwrap();
        };
        let big = MAX_FOOTER as u32 + 1;
        for (magic, format) in [
            (&b"PAR1"[..], Format::Parquet),
            (b"ARROW1", Format::IpcFile),
        ] {
            file(big, magic);
            let why = check_footer(&p, format).unwrap().unwrap_err();
            assert!(why.contains(&big.to_string()), "{why}");
            file(100, magic);
            assert_eq!(check_footer(&p, format).unwrap(), Ok(()));
        }
        file(big, b"\xff\xff\xff\xff");
        assert_eq!(check_footer(&p, Format::IpcStream).unwrap(), Ok(()));
    }

    #[test]
    fn columns_must_match_by_name_and_type_metadata_aside() {
        let f = |n: &str, t: DataType| Field::new(n, t, true);
        let share = Schema::new(vec![f("a", DataType::Int64), f("b", DataType::Utf8)]);
        let tagged = Schema::new_with_metadata(
            share.fields().clone(),
            std::collections::HashMap::from([("pandas".to_string(), "{}".to_string())]),
        );
        assert_eq!(mismatch(&share, &tagged), None);
        let retyped = Schema::new(vec![f("a", DataType::Int32), f("b", DataType::Utf8)]);
        assert_eq!(
            mismatch(&share, &retyped).unwrap(),
            "[a: Int32, b: Utf8] against [a: Int64, b: Utf8]"
        );
        let fewer = Schema::new(vec![f("a", DataType::Int64)]);
        assert!(mismatch(&share, &fewer).is_some());
        let renamed = Schema::new(vec![f("b", DataType::Int64), f("a", DataType::Utf8)]);
        assert!(mismatch(&share, &renamed).is_some());
    }

    #[test]
    fn a_flight_dir_that_cannot_hold_every_calls_budget_is_refused() {
        let dir = Path::new("/var/lib/kt/flight");
        let e = check_space(dir, 100, 60, 2).unwrap_err().to_string();
        for n in [
            "100 bytes free",
            "(60 bytes)",
            "(2)",
            "120 bytes",
            "/var/lib/kt/flight",
        ] {
            assert!(e.contains(n), "{n}: {e}");
        }
        assert!(check_space(dir, 120, 60, 2).is_ok());
        // The real free space: no filesystem holds 16 calls of 2^60 bytes.
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg = FlightConfig::new("127.0.0.1:0".parse().unwrap());
        cfg.budget = 1 << 60;
        let e = Shares::new("http://127.0.0.1:1", tmp.path().join("flight"), &cfg).unwrap_err();
        assert!(
            matches!(e, FlightSetupError::NoSpace { calls: 16, budget, .. } if budget == 1 << 60),
            "{e}"
        );
        cfg.budget = 1 << 10;
        Shares::new("http://127.0.0.1:1", tmp.path().join("flight"), &cfg).unwrap();
    }

    #[test]
    fn in_a_pod_the_flight_dir_must_be_given() {
        let state = Path::new("/var/lib/kt/agent");
        let mut cfg = FlightConfig::new("127.0.0.1:0".parse().unwrap());
        let e = scratch_dir(&cfg, state, true).unwrap_err().to_string();
        for n in [
            "--flight-dir",
            kt_types::env::FLIGHT_DIR,
            kt_types::env::POD_IP,
            "node's disk",
        ] {
            assert!(e.contains(n), "{n}: {e}");
        }
        // Outside a pod (a developer's machine, the tests): the default.
        assert_eq!(
            scratch_dir(&cfg, state, false).unwrap(),
            state.join("flight")
        );
        cfg.dir = Some(PathBuf::from("/var/lib/kt/flight"));
        for in_pod in [true, false] {
            assert_eq!(
                scratch_dir(&cfg, state, in_pod).unwrap(),
                Path::new("/var/lib/kt/flight")
            );
        }
    }

    #[test]
    fn a_tokens_calls_are_capped_and_given_back() {
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg = FlightConfig::new("127.0.0.1:0".parse().unwrap());
        cfg.budget = 1 << 10;
        cfg.max_calls = 3;
        cfg.per_token = 2;
        let shares = Shares::new("http://127.0.0.1:1", tmp.path().join("f"), &cfg).unwrap();
        let a1 = shares.take_slots("a").unwrap();
        let a2 = shares.take_slots("a").unwrap();
        let e = shares.take_slots("a").unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(
            e.message().contains("--flight-max-calls-per-token"),
            "{e:?}"
        );
        let b = shares.take_slots("b").unwrap();
        // The agent's limit: no slot left for anyone.
        let e = shares.take_slots("c").unwrap_err();
        assert!(e.message().contains("(--flight-max-calls)"), "{e:?}");
        drop(a1);
        let a3 = shares.take_slots("a").unwrap();
        drop((a2, a3, b));
        assert!(shares.tokens.lock().unwrap().is_empty());
    }

    #[test]
    fn kt_errors_keep_their_meaning_in_grpc() {
        let api = |code: ErrorCode| ClientError::Api {
            status: code.http_status(),
            code,
            message: "m".into(),
        };
        for (code, want) in [
            (ErrorCode::Unauthorized, tonic::Code::Unauthenticated),
            (ErrorCode::Forbidden, tonic::Code::PermissionDenied),
            (ErrorCode::NotFound, tonic::Code::NotFound),
            (ErrorCode::InvalidKey, tonic::Code::InvalidArgument),
            (ErrorCode::HashMismatch, tonic::Code::DataLoss),
            (ErrorCode::NoSource, tonic::Code::Unavailable),
            (ErrorCode::Internal, tonic::Code::Internal),
        ] {
            assert_eq!(status(&api(code)).code(), want, "{code:?}");
        }
    }

    #[test]
    fn the_bearer_token_is_required_and_read_from_the_header() {
        let mut meta = tonic::metadata::MetadataMap::new();
        assert_eq!(
            bearer(&meta).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        meta.insert("authorization", "Basic abc".parse().unwrap());
        assert!(bearer(&meta).is_err());
        meta.insert("authorization", "Bearer  tok-1 ".parse().unwrap());
        assert_eq!(bearer(&meta).unwrap(), "tok-1");
    }
}
