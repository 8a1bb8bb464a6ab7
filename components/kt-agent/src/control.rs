//! The local control socket ([`kt_types::agent`]): a Unix socket, mode 0600,
//! speaking length-prefixed JSON. Each connection must start with `hello`
//! (a version it does not speak is answered with an error, and the
//! connection closed); then one reply per request. Many clients may be
//! connected at once.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kt_service::ApiError;
use kt_sync::{ScanCache, SyncError};
use kt_types::agent::{
    CONTROL_VERSION, ControlReply, ControlRequest, ExportInfo, KEEPALIVE, MIN_CONTROL_VERSION,
    TENSOR_VERSION, encode_frame, frame_len,
};
use kt_types::api::{PutOptions, RegisterKey};
use kt_types::manifest::EntryKind;
use kt_types::manifest::ManifestLimits;
use kt_types::{ErrorCode, Key, Locale, Manifest, RootKind};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

use crate::exports::{Export, Exports};
use crate::metadata::MetadataClient;
use crate::tensors::{Owner, Tensors};

/// Longest version id an export may carry.
const MAX_VERSION_LEN: usize = 256;

/// What control requests act on.
#[derive(Debug)]
pub struct Agent {
    pub id: String,
    pub url: String,
    pub exports: Arc<Exports>,
    pub metadata: Arc<MetadataClient>,
    pub limits: ManifestLimits,
    /// Held from registration to export of a local put.
    pub local_puts: tokio::sync::Mutex<()>,
    pub tensors: Arc<Tensors>,
    /// Where exports may be.
    pub exportable: crate::exportable::Exportable,
    /// The shared-memory directory of host tensors, named in every hello.
    pub shm_dir: PathBuf,
    /// Control connections open now.
    pub clients: std::sync::atomic::AtomicUsize,
}

impl Agent {
    /// Nothing needs this agent now: no client is connected, no local put
    /// is served from here (its origin), no tensor is registered.
    /// Downloaded copies do not count: other sources hold them.
    pub fn idle(&self) -> bool {
        self.clients.load(std::sync::atomic::Ordering::Relaxed) == 0
            && !self.exports.all().iter().any(|e| e.origin)
            && self.tensors.registrations().is_empty()
    }

    /// `path`, canonical, if it may be exported.
    async fn exportable(&self, path: &str) -> Result<PathBuf, ApiError> {
        let root = canonical(path).await?;
        match self.exportable.refuses(&root) {
            Some(why) => Err(kt_service::forbidden(why)),
            None => Ok(root),
        }
    }
}

/// The other end of a control connection.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The version agreed in the handshake.
    pub version: u32,
    pub owner: Owner,
    /// Cancelled once the client is gone (it closed its end, or a reply
    /// could not be written to it): a request then gives up what it only
    /// waits for (a quorum join leaves its round), and runs the rest to
    /// its end.
    pub gone: CancellationToken,
}

impl Agent {
    /// Answers one request (after the handshake). Failures are `Error` replies.
    pub async fn handle(&self, req: ControlRequest, caller: &Caller) -> ControlReply {
        let tensor_op = matches!(
            req,
            ControlRequest::PutTensors(_)
                | ControlRequest::GetTensors(_)
                | ControlRequest::DropTensors { .. }
                | ControlRequest::WithdrawPut { .. }
        );
        if tensor_op && caller.version < TENSOR_VERSION {
            return ControlReply::Error {
                code: ErrorCode::InvalidRequest,
                message: format!(
                    "tensor operations need control protocol {TENSOR_VERSION}; this connection said hello with {}",
                    caller.version
                ),
            };
        }
        let res = match req {
            ControlRequest::Hello { version, keepalive } => Ok(self.hello(version, keepalive)),
            ControlRequest::PutTensors(put) => self
                .tensors
                .put(caller.owner.clone(), put, &caller.gone)
                .await
                .map(ControlReply::TensorsPut),
            ControlRequest::GetTensors(get) => self
                .tensors
                .get(&caller.owner, get, &caller.gone)
                .await
                .map(|stats| ControlReply::TensorsGot { stats }),
            ControlRequest::DropTensors { key } => self
                .tensors
                .drop_key(&caller.owner, &key)
                .await
                .map(|()| ControlReply::TensorsDropped { key }),
            ControlRequest::WithdrawPut { key } => self
                .tensors
                .withdraw_put(&caller.owner, &key)
                .map(|joins| ControlReply::PutWithdrawn { key, joins }),
            ControlRequest::ExportLocal { key, path, options } => {
                self.export_local(key, &path, options).await
            }
            ControlRequest::ExportCopy {
                key,
                version,
                path,
                manifest,
            } => self.export_copy(key, version, &path, manifest).await,
            ControlRequest::Status => Ok(ControlReply::Status {
                agent: self.id.clone(),
                url: self.url.clone(),
                exports: self.exports.all().iter().map(|e| e.info()).collect(),
                tensors: self.tensors.registrations(),
            }),
        };
        res.unwrap_or_else(|e| ControlReply::Error {
            code: e.code,
            message: e.message,
        })
    }

    fn hello(&self, version: u32, keepalive: bool) -> ControlReply {
        if !(MIN_CONTROL_VERSION..=CONTROL_VERSION).contains(&version) {
            return ControlReply::Error {
                code: ErrorCode::InvalidRequest,
                message: format!(
                    "control protocol version {version} is not spoken here; this agent speaks {MIN_CONTROL_VERSION} to {CONTROL_VERSION}"
                ),
            };
        }
        ControlReply::Hello {
            version,
            agent: self.id.clone(),
            url: self.url.clone(),
            keepalive,
            shm_dir: Some(self.shm_dir.display().to_string()),
        }
    }

    /// `kt put --locale local`: scan the user's files in place, serve them,
    /// register the key with this agent as its holder.
    async fn export_local(
        &self,
        key: Key,
        path: &str,
        options: PutOptions,
    ) -> Result<ControlReply, ApiError> {
        let root = self.exportable(path).await?;
        let cache_path = self.exports.scan_cache(&key);
        let limits = self.limits;
        let scan_root = root.clone();
        let manifest = kt_service::blocking(move || {
            let mut cache = ScanCache::load(&cache_path);
            let m = kt_sync::scan(&scan_root, &mut cache)?;
            m.validate(&limits)?;
            if cache.dirty
                && let Err(e) = cache.save(&cache_path)
            {
                tracing::warn!(error = %e, "could not save a scan cache");
            }
            Ok(m)
        })
        .await?;
        let digest = kt_sync::manifest_digest(&manifest);
        let version = digest.to_hex();
        let reg = RegisterKey {
            locale: Locale::Local,
            source: self.url.clone(),
            holder: Some(self.id.clone()),
            version: version.clone(),
            is_dir: manifest.root == RootKind::Dir,
            size: manifest.total_bytes(),
            files: manifest.file_count(),
            tensors: None,
            digest: Some(digest),
            options: options.clone(),
            only_if: None,
        };
        let export = Export {
            key: key.clone(),
            version,
            path: root,
            origin: true,
            options,
            manifest: Arc::new(manifest),
        };
        // Registered, then served: a heartbeat never announces a version the
        // metadata server does not know yet (it would answer "drop"). One
        // local put at a time, so records and exports agree on the last one.
        let _one = self.local_puts.lock().await;
        let record = self.metadata.register(&key, &reg).await?;
        self.exports
            .insert(export.clone())
            .await
            .map_err(internal)?;
        tracing::info!(%key, version = %export.version, path = %export.path.display(), "exported (local put)");
        Ok(ControlReply::Exported {
            export: export.info(),
            record: Some(Box::new(record)),
        })
    }

    /// After a get: serve the downloaded copy (its manifest's entries only).
    async fn export_copy(
        &self,
        key: Key,
        version: String,
        path: &str,
        manifest: Manifest,
    ) -> Result<ControlReply, ApiError> {
        if version.is_empty()
            || version.len() > MAX_VERSION_LEN
            || version.chars().any(char::is_control)
        {
            return Err(ApiError::bad_request(format!(
                "version {version:?} is empty, longer than {MAX_VERSION_LEN} bytes or has control characters"
            )));
        }
        manifest.validate(&self.limits)?;
        let root = self.exportable(path).await?;
        let want_dir = manifest.root == RootKind::Dir;
        let check = root.clone();
        let kind_ok = kt_service::blocking(move || {
            let md = std::fs::metadata(&check).map_err(|e| SyncError::io(&check, e))?;
            Ok(if want_dir { md.is_dir() } else { md.is_file() })
        })
        .await?;
        if !kind_ok {
            return Err(ApiError::bad_request(format!(
                "{path:?} is not a {} as the manifest says",
                if want_dir { "directory" } else { "file" }
            )));
        }
        // What is served is what is on disk: every entry as the manifest
        // describes it (kind, size, link target), nothing taken on trust.
        let (on_disk, check) = (manifest.clone(), root.clone());
        kt_service::blocking(move || Ok(matches_disk(&check, &on_disk)))
            .await?
            .map_err(|why| {
                ApiError::bad_request(format!("{path:?} is not what its manifest says: {why}"))
            })?;
        if let Some(cur) = self.exports.get(&key).filter(|e| e.origin) {
            // This pod is the key's origin: the origin export stays. A copy
            // of another version is no newer for that: a get that leased
            // an older version before this pod put the key again ends
            // after the put, and its copy in the origin's place would leave
            // the key's registered origin serving nothing once the
            // metadata server drops the copy (the chaos soak, seed
            // 97147130). If another pod put the key since, the metadata
            // server drops this export on the next heartbeat.
            if cur.version == version {
                return Ok(exported(cur.info()));
            }
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "this pod is the origin of {key} at version {}: a downloaded copy of version {version} is not served in its place",
                    cur.version
                ),
            ));
        }
        let export = Export {
            key: key.clone(),
            version,
            path: root,
            origin: false,
            options: PutOptions::default(),
            manifest: Arc::new(manifest),
        };
        self.exports
            .insert(export.clone())
            .await
            .map_err(internal)?;
        tracing::info!(%key, version = %export.version, path = %export.path.display(), "exported (downloaded copy)");
        Ok(exported(export.info()))
    }
}

/// Whether `root` holds `manifest`'s entries as it says (by `lstat`: kind,
/// a file's size, a link's target); the first difference otherwise.
fn matches_disk(root: &Path, manifest: &Manifest) -> Result<(), String> {
    for e in &manifest.entries {
        let p = match manifest.root {
            RootKind::File => root.to_owned(),
            RootKind::Dir => root.join(&e.path),
        };
        let md = std::fs::symlink_metadata(&p).map_err(|err| format!("{:?}: {err}", e.path))?;
        let ok = match e.kind {
            EntryKind::File => md.is_file() && md.len() == e.size,
            EntryKind::Dir => md.is_dir(),
            EntryKind::Symlink => {
                md.is_symlink()
                    && std::fs::read_link(&p).is_ok_and(|t| {
                        Some(t.as_os_str()) == e.target.as_deref().map(std::ffi::OsStr::new)
                    })
            }
        };
        if !ok {
            let disk = if md.is_symlink() {
                format!(
                    "a symlink to {:?}",
                    std::fs::read_link(&p).unwrap_or_default()
                )
            } else if md.is_dir() {
                "a directory".to_owned()
            } else if md.is_file() {
                format!("a file of {} bytes", md.len())
            } else {
                "neither a file, a directory nor a symlink".to_owned()
            };
            let want = match e.kind {
                EntryKind::File => format!("a file of {} bytes", e.size),
                EntryKind::Dir => "a directory".to_owned(),
                EntryKind::Symlink => {
                    format!("a symlink to {:?}", e.target.as_deref().unwrap_or(""))
                }
            };
            return Err(format!(
                "{:?}: the manifest says {want}, the disk has {disk}",
                e.path
            ));
        }
    }
    Ok(())
}

fn exported(export: ExportInfo) -> ControlReply {
    ControlReply::Exported {
        export,
        record: None,
    }
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    tracing::error!(error = %e, "agent state");
    ApiError::internal(e.to_string())
}

/// The canonical form of an absolute path that exists.
async fn canonical(path: &str) -> Result<PathBuf, ApiError> {
    let p = PathBuf::from(path);
    if !p.is_absolute() {
        return Err(ApiError::bad_request(format!(
            "path {path:?} must be absolute"
        )));
    }
    kt_service::blocking(move || std::fs::canonicalize(&p).map_err(|e| SyncError::io(&p, e))).await
}

/// The control socket file; removed on drop if it is still the one we bound.
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    id: (u64, u64),
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("control socket {}: another agent is listening there", .0.display())]
    InUse(PathBuf),
    #[error("control socket {}: something other than a socket is in the way", .0.display())]
    NotASocket(PathBuf),
    #[error(
        "control socket directory {} belongs to uid {owner} (mode {mode:o}), and this agent \
         (uid {me}) may not move it aside: remove it, or give the agent a socket path of its own",
        .dir.display()
    )]
    UnsafeDir {
        dir: PathBuf,
        owner: u32,
        mode: u32,
        me: u32,
    },
    #[error(
        "control socket {}: cannot give it to group {gid} ({source}): the agent must be a member \
         (the pod's fsGroup, or a supplemental group)",
        path.display()
    )]
    Group {
        path: PathBuf,
        gid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("control socket {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Binds the control socket at `path` (mode 0600; its directory is made
/// this user's alone first, [`socket_dir`]). A stale socket (nobody
/// listening) is replaced; a live one is an error. With `group` (a gid the
/// agent is a member of: the pod's `fsGroup`), the directory is 0750 and
/// the socket 0660 in that group, so workloads running as other users of
/// the group reach the agent (and the agent may run as a user of its own).
pub fn bind(path: &Path, group: Option<u32>) -> Result<(UnixListener, SocketFile), SocketError> {
    let io = |source| SocketError::Io {
        path: path.to_owned(),
        source,
    };
    let shared = |p: &Path, mode: u32| -> Result<(), SocketError> {
        let Some(gid) = group else { return Ok(()) };
        let failed = |source: std::io::Error| SocketError::Group {
            path: p.to_owned(),
            gid,
            source,
        };
        std::os::unix::fs::chown(p, None, Some(gid)).map_err(failed)?;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).map_err(failed)
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        socket_dir(dir, kt_service::cli::uid())?;
        shared(dir, 0o750)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(SocketError::InUse(path.to_owned()));
            }
            tracing::info!(socket = %path.display(), "replacing a stale control socket");
            std::fs::remove_file(path).map_err(io)?;
        }
        Ok(_) => return Err(SocketError::NotASocket(path.to_owned())),
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    shared(path, 0o660)?;
    let md = std::fs::symlink_metadata(path).map_err(io)?;
    Ok((
        listener,
        SocketFile {
            path: path.to_owned(),
            id: (md.dev(), md.ino()),
        },
    ))
}

/// The agent's state directory: made 0700 when missing, narrowed to 0700
/// when it is this user's. One that is not (the root of a volume mounted
/// for it) is left as it is: what the agent writes there goes into
/// subdirectories it makes 0700 ([`crate::exports::Exports::open`]).
pub fn private_dir(dir: &Path, uid: u32) -> Result<(), SocketError> {
    let io = |source| SocketError::Io {
        path: dir.to_owned(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io)?;
    let md = std::fs::symlink_metadata(dir).map_err(io)?;
    if md.is_dir() && md.uid() == uid && md.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
    }
    Ok(())
}

/// Makes `dir` a directory of `uid`'s that only it may write to, whoever
/// got there first: created 0700 when missing; this user's own that others
/// may write to loses those bits. Anything else there (another user's directory, a
/// symlink, a file) could swap the socket, so it is moved aside to
/// `<dir>.stale-<n>` and a fresh one made, when the parent lets this user
/// do that: a parent writable by others without the sticky bit (an
/// emptyDir's root) lets anyone move entries anyway. In a sticky parent
/// (`/tmp`) another user's entry cannot be moved, and that is an error
/// naming its owner.
pub fn socket_dir(dir: &Path, uid: u32) -> Result<(), SocketError> {
    let io = |source| SocketError::Io {
        path: dir.to_owned(),
        source,
    };
    let create = || {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
    };
    create()
        .or_else(|e| match e.kind() {
            // A file or a dangling symlink in the way: handled below.
            std::io::ErrorKind::AlreadyExists | std::io::ErrorKind::NotADirectory => Ok(()),
            _ => Err(e),
        })
        .map_err(io)?;
    let md = std::fs::symlink_metadata(dir).map_err(io)?;
    if md.is_dir() && md.uid() == uid {
        if md.mode() & 0o022 != 0 {
            let tight = md.mode() & 0o7755;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(tight)).map_err(io)?;
        }
        return Ok(());
    }
    let unsafe_dir = || SocketError::UnsafeDir {
        dir: dir.to_owned(),
        owner: md.uid(),
        mode: md.mode() & 0o7777,
        me: uid,
    };
    let sticky = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .and_then(|p| std::fs::metadata(p).ok())
        .is_none_or(|p| p.mode() & 0o1000 != 0);
    if sticky {
        return Err(unsafe_dir());
    }
    let mut n = 0u32;
    let aside = loop {
        let mut name = dir.as_os_str().to_owned();
        name.push(format!(".stale-{n}"));
        let aside = PathBuf::from(name);
        if std::fs::symlink_metadata(&aside).is_err() {
            break aside;
        }
        n += 1;
        if n > 100 {
            return Err(unsafe_dir());
        }
    };
    std::fs::rename(dir, &aside).map_err(|_| unsafe_dir())?;
    tracing::warn!(
        dir = %dir.display(),
        owner = md.uid(),
        moved_to = %aside.display(),
        "the control socket's directory was not this agent's: moved it aside"
    );
    create().map_err(io)?;
    let md = std::fs::symlink_metadata(dir).map_err(io)?;
    if !md.is_dir() || md.uid() != uid || md.mode() & 0o022 != 0 {
        // Someone raced us to it again.
        return Err(SocketError::UnsafeDir {
            dir: dir.to_owned(),
            owner: md.uid(),
            mode: md.mode() & 0o7777,
            me: uid,
        });
    }
    Ok(())
}

/// Accepts control connections until `shutdown`.
pub async fn serve(listener: UnixListener, agent: Arc<Agent>, shutdown: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, _)) => {
                tokio::spawn(connection(stream, agent.clone(), shutdown.clone()));
            }
            Err(e) => {
                tracing::warn!(error = %e, "control socket accept failed");
                // Out of file descriptors and the like: do not spin.
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

enum Incoming {
    Frame(Vec<u8>),
    Closed,
    Refused(String),
}

/// What a client sent of its next request while one ran (see
/// [`Ahead::gone`]): at most a frame's header, kept for [`read_frame`].
#[derive(Debug, Default)]
struct Ahead {
    head: [u8; 4],
    filled: usize,
}

impl Ahead {
    /// Reads what the client sends while a request runs, up to the next
    /// frame's header, and ends once the client closed its end (or reading
    /// failed); while the client is there it never ends. Cancel-safe: what
    /// was read stays here.
    async fn gone<R: AsyncRead + Unpin>(&mut self, stream: &mut R) {
        while self.filled < self.head.len() {
            match stream.read(&mut self.head[self.filled..]).await {
                Ok(0) | Err(_) => return,
                Ok(n) => self.filled += n,
            }
        }
        std::future::pending().await
    }
}

async fn read_frame<R: AsyncRead + Unpin>(
    stream: &mut R,
    ahead: &mut Ahead,
) -> std::io::Result<Incoming> {
    let mut head = ahead.head;
    let filled = std::mem::take(&mut ahead.filled);
    match stream.read_exact(&mut head[filled..]).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(Incoming::Closed),
        Err(e) => return Err(e),
    }
    let n = match frame_len(head) {
        Ok(n) => n,
        Err(msg) => return Ok(Incoming::Refused(msg)),
    };
    // Grown as bytes arrive: a header announcing a large frame costs
    // nothing until the peer actually sends it.
    let mut body = Vec::new();
    (&mut *stream).take(n as u64).read_to_end(&mut body).await?;
    if body.len() != n {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Incoming::Frame(body))
}

async fn write_reply<W: AsyncWrite + Unpin>(
    stream: &mut W,
    reply: &ControlReply,
) -> std::io::Result<()> {
    let frame = encode_frame(reply).map_err(std::io::Error::other)?;
    stream.write_all(&frame).await
}

/// `work` in the trace of the client's request (its frame's
/// `traceparent`, when well formed; else a new one): in a `control` span
/// naming the trace, and carried on the calls it makes.
fn traced<F: std::future::Future>(
    body: &[u8],
    work: F,
) -> impl std::future::Future<Output = F::Output> {
    use tracing::Instrument;
    let parent =
        kt_types::agent::frame_traceparent(body).and_then(kt_api::trace::TraceParent::parse);
    let span = tracing::info_span!(
        "control",
        trace_id = tracing::field::Empty,
        server = "agent"
    );
    let trace = kt_service::trace::start(&span, parent);
    kt_api::trace::scope(Some(trace), work).instrument(span)
}

/// Runs `work` while watching the client: says [`ControlReply::Working`]
/// every `every` (when it asked for that) and reads what it sends
/// meanwhile ([`Ahead`]). Its answer, and whether the client still listens.
/// A client that closed its end (its sending half: clients keep it open
/// until their reply), or that a `Working` could not be written to, is
/// gone: `gone` is cancelled, and the work gives up only what it waits for
/// (a quorum join); the rest runs to its end (a put is registered or not,
/// never half). A client a `Working` could not be written to, or not taken
/// from within `every` (not reading), no longer listens: the connection is
/// closed after the work (a frame may have been cut).
async fn watched<R, W>(
    (rd, wr): (&mut R, &mut W),
    ahead: &mut Ahead,
    work: impl std::future::Future<Output = ControlReply>,
    every: Option<Duration>,
    gone: &CancellationToken,
) -> (ControlReply, bool)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    tokio::pin!(work);
    let period = every.unwrap_or(KEEPALIVE);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    let mut listening = true;
    loop {
        tokio::select! {
            reply = &mut work => return (reply, listening),
            _ = tick.tick(), if listening && every.is_some() => {
                let said = tokio::time::timeout(period, write_reply(wr, &ControlReply::Working));
                match said.await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => {
                        listening = false;
                        gone.cancel();
                    }
                    Err(_) => listening = false,
                }
            }
            // Its reply is still written: a client that only shut its
            // sending half reads it.
            () = ahead.gone(rd), if !gone.is_cancelled() => gone.cancel(),
        }
    }
}

/// Ends the agent (cancels `shutdown`) once it has been [`Agent::idle`]
/// for `grace` without a break (`--exit-when-idle`: an agent a client
/// started on demand ends with its last client).
pub async fn exit_when_idle(agent: Arc<Agent>, grace: Duration, shutdown: CancellationToken) {
    let tick = (grace / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
    let mut idle_since: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(tick) => {}
        }
        if !agent.idle() {
            idle_since = None;
            continue;
        }
        let since = *idle_since.get_or_insert_with(tokio::time::Instant::now);
        if since.elapsed() >= grace {
            tracing::info!(
                grace = %humantime::format_duration(grace),
                "no client, local put or tensor for the idle grace: the agent ends (--exit-when-idle)"
            );
            shutdown.cancel();
            return;
        }
    }
}

/// Counts an open control connection while alive.
struct Connected<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> Connected<'a> {
    fn new(n: &'a std::sync::atomic::AtomicUsize) -> Self {
        n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Connected(n)
    }
}

impl Drop for Connected<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One client: hello first, then requests answered in order.
async fn connection(stream: UnixStream, agent: Arc<Agent>, shutdown: CancellationToken) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let _connected = Connected::new(&agent.clients);
    let conn = NEXT.fetch_add(1, Ordering::Relaxed);
    let pid = stream.peer_cred().ok().and_then(|c| c.pid());
    agent.tensors.connection_opened(conn);
    let caller = Caller {
        version: 0,
        owner: Owner::of(pid, conn),
        gone: CancellationToken::new(),
    };
    converse(stream, &agent, caller, shutdown).await;
    agent.tensors.connection_closed(conn);
}

async fn converse(
    mut stream: UnixStream,
    agent: &Agent,
    mut caller: Caller,
    shutdown: CancellationToken,
) {
    let (mut rd, mut wr) = stream.split();
    let mut ahead = Ahead::default();
    let mut greeted = false;
    // The client asked for `Working` while its requests run.
    let mut working = false;
    loop {
        let incoming = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = read_frame(&mut rd, &mut ahead) => r,
        };
        let body = match incoming {
            Ok(Incoming::Frame(b)) => b,
            Ok(Incoming::Closed) => return,
            Ok(Incoming::Refused(msg)) => {
                let reply = ControlReply::Error {
                    code: ErrorCode::PayloadTooLarge,
                    message: msg,
                };
                let _ = write_reply(&mut wr, &reply).await;
                return;
            }
            Err(e) => {
                tracing::debug!(error = %e, "control connection ended");
                return;
            }
        };
        let (reply, close) = match serde_json::from_slice::<ControlRequest>(&body) {
            Err(e) => (
                ControlReply::Error {
                    code: ErrorCode::InvalidRequest,
                    message: format!("unreadable control request: {e}"),
                },
                !greeted,
            ),
            Ok(ControlRequest::Hello { version, keepalive }) => {
                let reply = agent.hello(version, keepalive);
                greeted = matches!(reply, ControlReply::Hello { .. });
                caller.version = version;
                working = greeted && keepalive;
                (reply, !greeted)
            }
            Ok(_) if !greeted => (
                ControlReply::Error {
                    code: ErrorCode::InvalidRequest,
                    message: "the first request must be hello".to_owned(),
                },
                true,
            ),
            Ok(req) => {
                // A request whose client went away gives up only what it
                // waits for (`watched`): a put is registered or not, never half.
                let work = traced(&body, agent.handle(req, &caller));
                let every = working.then_some(KEEPALIVE);
                let (reply, listening) =
                    watched((&mut rd, &mut wr), &mut ahead, work, every, &caller.gone).await;
                if !listening {
                    tracing::debug!("control client went away or stopped listening mid-request");
                    return;
                }
                (reply, false)
            }
        };
        if let Err(e) = write_reply(&mut wr, &reply).await {
            tracing::debug!(error = %e, "control client went away");
            return;
        }
        if close {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_long_request_says_it_is_working_until_its_answer() {
        let (mut agent_end, mut client) = UnixStream::pair().unwrap();
        let every = std::time::Duration::from_millis(100);
        let work = async {
            tokio::time::sleep(every * 3 + every / 2).await;
            ControlReply::Working // any reply: the caller writes it
        };
        let reading = tokio::spawn(async move {
            let mut frames = Vec::new();
            let mut ahead = Ahead::default();
            while let Ok(Incoming::Frame(b)) = read_frame(&mut client, &mut ahead).await {
                frames.push(serde_json::from_slice::<ControlReply>(&b).unwrap());
            }
            frames
        });
        let gone = CancellationToken::new();
        let (mut rd, mut wr) = agent_end.split();
        let mut ahead = Ahead::default();
        let (_, listening) =
            watched((&mut rd, &mut wr), &mut ahead, work, Some(every), &gone).await;
        assert!(listening && !gone.is_cancelled());
        drop(agent_end);
        let frames = reading.await.unwrap();
        // Ticks at 100, 200 and 300 ms, the answer at 350 ms (a loaded
        // machine may fold the last tick into the answer).
        assert!(
            (2..=3).contains(&frames.len()) && frames.iter().all(|f| *f == ControlReply::Working),
            "{frames:?}"
        );
    }

    #[tokio::test]
    async fn a_client_that_closes_its_end_mid_request_is_gone_and_the_wait_given_up() {
        // Without keepalive the close is read; with it, a `Working` may
        // also fail to go out first: gone either way.
        for every in [None, Some(Duration::from_millis(50))] {
            let (mut agent_end, client) = UnixStream::pair().unwrap();
            let gone = CancellationToken::new();
            // Work that only waits (a quorum join): given up once gone.
            let work = async {
                gone.cancelled().await;
                ControlReply::Error {
                    code: ErrorCode::Unavailable,
                    message: "given up".into(),
                }
            };
            drop(client);
            let (mut rd, mut wr) = agent_end.split();
            let mut ahead = Ahead::default();
            let watching = watched((&mut rd, &mut wr), &mut ahead, work, every, &gone);
            // The window a quorum wait would otherwise hold on for is far longer.
            let (reply, listening) = tokio::time::timeout(Duration::from_secs(30), watching)
                .await
                .expect("the client's going noticed");
            assert!(gone.is_cancelled(), "{every:?}");
            // Read, the close leaves the reply to be written (it fails if
            // the client is gone for good); a `Working` that failed, not.
            assert!(listening || every.is_some(), "{every:?}");
            assert!(matches!(reply, ControlReply::Error { .. }), "{reply:?}");
        }
    }

    #[tokio::test]
    async fn what_a_client_sends_while_a_request_runs_is_its_next_request_whole() {
        let (mut agent_end, mut client) = UnixStream::pair().unwrap();
        let next = ControlRequest::Status;
        let frame = encode_frame(&next).unwrap();
        let (sent, was_sent) = tokio::sync::oneshot::channel();
        let f = frame.clone();
        let sending = tokio::spawn(async move {
            client.write_all(&f).await.unwrap();
            sent.send(()).unwrap();
            client
        });
        // The running request ends once the next one went out whole,
        // read ahead or not: either way it arrives intact.
        let work = async {
            was_sent.await.unwrap();
            ControlReply::Working
        };
        let gone = CancellationToken::new();
        let mut ahead = Ahead::default();
        let (mut rd, mut wr) = agent_end.split();
        let (_, listening) = watched((&mut rd, &mut wr), &mut ahead, work, None, &gone).await;
        assert!(listening && !gone.is_cancelled());
        let Incoming::Frame(body) = read_frame(&mut rd, &mut ahead).await.unwrap() else {
            panic!("no frame");
        };
        assert_eq!(
            serde_json::from_slice::<ControlRequest>(&body).unwrap(),
            next
        );
        let _client = sending.await.unwrap();
        // A header read ahead in part or whole: the frame reads the rest.
        for filled in [1, 4] {
            let (mut agent_end, mut client) = UnixStream::pair().unwrap();
            let mut ahead = Ahead::default();
            ahead.head.copy_from_slice(&frame[..4]);
            ahead.filled = filled;
            client.write_all(&frame[filled..]).await.unwrap();
            let Incoming::Frame(body) = read_frame(&mut agent_end, &mut ahead).await.unwrap()
            else {
                panic!("no frame");
            };
            assert_eq!(
                serde_json::from_slice::<ControlRequest>(&body).unwrap(),
                next
            );
            assert_eq!(ahead.filled, 0);
        }
    }

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    #[tokio::test]
    async fn a_socket_group_opens_the_socket_to_the_group_only() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        // The group this process creates files with: one it is a member of.
        let probe = tmp.path().join("probe");
        std::fs::write(&probe, b"").unwrap();
        let gid = std::fs::metadata(&probe).unwrap().gid();
        let (_l, _f) = bind(&dir.join("agent.sock"), Some(gid)).unwrap();
        assert_eq!(mode(&dir), 0o750);
        assert_eq!(mode(&dir.join("agent.sock")), 0o660);
        assert_eq!(
            std::fs::metadata(dir.join("agent.sock")).unwrap().gid(),
            gid
        );
        // Without one: the agent's user alone.
        let (_l, _f) = bind(&tmp.path().join("own/agent.sock"), None).unwrap();
        assert_eq!(mode(&tmp.path().join("own")), 0o700);
        assert_eq!(mode(&tmp.path().join("own/agent.sock")), 0o600);
    }

    #[test]
    fn a_missing_socket_dir_is_made_this_users_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b");
        socket_dir(&dir, kt_service::cli::uid()).unwrap();
        assert!(dir.is_dir());
        assert_eq!(mode(&dir), 0o700);
    }

    #[test]
    fn an_own_dir_others_may_write_to_is_tightened() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("kt");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        socket_dir(&dir, kt_service::cli::uid()).unwrap();
        assert_eq!(mode(&dir), 0o755);
    }

    #[test]
    fn something_else_in_the_way_is_moved_aside_where_the_parent_allows_it() {
        // An emptyDir's root: writable by all, no sticky bit.
        let tmp = tempfile::tempdir().unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let dir = tmp.path().join("agent");
        std::os::unix::fs::symlink("/", &dir).unwrap();
        socket_dir(&dir, kt_service::cli::uid()).unwrap();
        let md = std::fs::symlink_metadata(&dir).unwrap();
        assert!(md.is_dir(), "a real directory replaced the symlink");
        assert_eq!(mode(&dir), 0o700);
        let aside = tmp.path().join("agent.stale-0");
        assert!(std::fs::symlink_metadata(&aside).unwrap().is_symlink());
        // Again with the first one aside: the next name.
        std::fs::remove_dir(&dir).unwrap();
        std::fs::write(&dir, b"not a directory").unwrap();
        socket_dir(&dir, kt_service::cli::uid()).unwrap();
        assert!(tmp.path().join("agent.stale-1").is_file());
    }

    #[test]
    fn another_users_entry_in_a_sticky_parent_is_refused_with_its_owner() {
        // /tmp: entries of others cannot be moved, so the agent says whose
        // it is instead of failing somewhere later.
        let tmp = tempfile::tempdir().unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        let dir = tmp.path().join("kt-1000");
        std::fs::create_dir(&dir).unwrap();
        let me = kt_service::cli::uid();
        let err = socket_dir(&dir, me + 1).unwrap_err();
        match &err {
            SocketError::UnsafeDir { owner, me: m, .. } => {
                assert_eq!((*owner, *m), (me, me + 1));
            }
            other => panic!("{other:?}"),
        }
        assert!(
            err.to_string().contains(&format!("belongs to uid {me}")),
            "{err}"
        );
        assert!(dir.is_dir(), "left where it was");
    }
}
