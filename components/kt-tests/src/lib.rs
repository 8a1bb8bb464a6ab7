//! Test harness: real metadata and store servers on `127.0.0.1:0`, in-process,
//! with the real client; helpers to build trees and compare them.

pub mod certs;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kt_client::{Client, ClientConfig};
use kt_service::Token;
use kt_sync::ScanCache;
use kt_types::Manifest;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const TOKEN: &str = "test-token";
/// Small chunks so chunked transfers are exercised with small data.
pub const CHUNK: u64 = 64 << 10;

/// Polls `f` until it returns true, or panics after `timeout`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if f().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[derive(Debug)]
struct Server {
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl Server {
    async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }
}

/// A metadata server and a store, each restartable on the same address and directory.
#[derive(Debug)]
pub struct Cluster {
    pub dir: tempfile::TempDir,
    meta: Option<Server>,
    store: Option<Server>,
    pub store_metrics: std::sync::Arc<kt_service::Metrics>,
    pub store_config: kt_store::Config,
    /// The tokens the metadata server accepts besides [`TOKEN`] (admin).
    meta_auth: Option<kt_service::Auth>,
}

async fn bind(addr: &str) -> TcpListener {
    TcpListener::bind(addr).await.expect("bind")
}

impl Cluster {
    pub async fn start() -> Cluster {
        Self::start_with(|_| {}).await
    }

    /// Starts both servers; `tune` adjusts the store's configuration.
    pub async fn start_with(tune: impl FnOnce(&mut kt_store::Config)) -> Cluster {
        Self::start_authed(None, tune).await
    }

    /// [`Cluster::start_with`], both servers also accepting the tokens of
    /// `auth` (a tokens file's grants); [`TOKEN`] stays admin, and the
    /// servers' own credential.
    pub async fn start_authed(
        auth: Option<kt_service::Auth>,
        tune: impl FnOnce(&mut kt_store::Config),
    ) -> Cluster {
        let auth = auth.map(|a| {
            a.with_grant(
                Token::new(TOKEN).expect("token"),
                kt_types::auth::Principal::admin(),
            )
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let meta = start_meta(dir.path(), "127.0.0.1:0", auth.as_ref()).await;
        let mut cfg = kt_store::Config::new(
            dir.path().join("store"),
            format!("http://{}", meta.addr),
            Token::new(TOKEN).expect("token"),
        );
        cfg.chunk_size = CHUNK;
        cfg.server.auth.clone_from(&auth);
        tune(&mut cfg);
        let (store, metrics) = start_store(&cfg, "127.0.0.1:0").await;
        let c = Cluster {
            dir,
            meta: Some(meta),
            store: Some(store),
            store_metrics: metrics,
            store_config: cfg,
            meta_auth: auth,
        };
        c.wait_ready().await;
        c
    }

    /// The shared-memory directory of this cluster's agents and tensors.
    pub fn shm_dir(&self) -> PathBuf {
        let d = self.dir.path().join("shm");
        std::fs::create_dir_all(&d).expect("shm dir");
        d
    }

    pub fn metadata_url(&self) -> String {
        format!(
            "http://{}",
            self.meta.as_ref().expect("metadata running").addr
        )
    }

    pub fn store_url(&self) -> String {
        format!(
            "http://{}",
            self.store.as_ref().expect("store running").addr
        )
    }

    pub fn store_data(&self) -> PathBuf {
        self.store_config.data_dir.clone()
    }

    /// A client with its own scan cache directory.
    pub fn client(&self) -> Client {
        self.client_with(|_| {})
    }

    /// [`Cluster::client`] with `tune` applied to its configuration.
    pub fn client_with(&self, tune: impl FnOnce(&mut ClientConfig)) -> Client {
        let mut cfg = ClientConfig::new(self.metadata_url(), TOKEN);
        cfg.cache_dir = Some(self.dir.path().join(format!("cache-{}", uuid_like())));
        // This test's own socket path: never an agent some other process runs.
        cfg.agent_socket = self.dir.path().join("client-agent.sock");
        tune(&mut cfg);
        Client::new(cfg).expect("client")
    }

    pub async fn wait_ready(&self) {
        let http = kt_api::client();
        let url = format!("{}/readyz", self.store_url());
        wait_until("store ready", Duration::from_secs(10), || {
            let (http, url) = (http.clone(), url.clone());
            async move {
                http.get(&url)
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success())
            }
        })
        .await;
    }

    pub async fn restart_store(&mut self) {
        let addr = self.stop_store().await;
        self.start_store(addr).await;
    }

    /// Starts a put of `src` under `key` and restarts the store (stopped,
    /// then started again on its address) once `bytes` of it are uploaded;
    /// the put's task, which carries on against the restarted store.
    pub async fn put_cut_by_store_restart(
        &mut self,
        key: &kt_types::Key,
        src: &Path,
        bytes: usize,
    ) -> JoinHandle<Result<kt_client::PutSummary, kt_client::ClientError>> {
        use std::sync::atomic::Ordering;
        let done = std::sync::Arc::new(BytesDone::default());
        let put = {
            let (client, key, src) = (self.client(), key.clone(), src.to_owned());
            let progress = kt_client::Progress::new(done.clone());
            tokio::spawn(async move {
                client
                    .put(&key, &src, kt_types::api::PutOptions::default(), progress)
                    .await
            })
        };
        wait_until("the put partway", Duration::from_secs(30), || {
            let done = done.clone();
            async move { done.0.load(Ordering::SeqCst) >= bytes }
        })
        .await;
        self.restart_store().await;
        put
    }

    /// Stops the store (an outage); its address, for [`Cluster::start_store`].
    pub async fn stop_store(&mut self) -> SocketAddr {
        let old = self.store.take().expect("store running");
        let addr = old.addr;
        old.stop().await;
        addr
    }

    /// Starts the store again on `addr` with the same data, and waits
    /// until it is ready.
    pub async fn start_store(&mut self, addr: SocketAddr) {
        let (store, metrics) = start_store(&self.store_config, &addr.to_string()).await;
        self.store = Some(store);
        self.store_metrics = metrics;
        self.wait_ready().await;
    }

    pub async fn restart_metadata(&mut self) {
        let addr = self.stop_metadata().await;
        self.start_metadata(addr).await;
    }

    /// Stops the metadata server (an outage); its address, for
    /// [`Cluster::start_metadata`].
    pub async fn stop_metadata(&mut self) -> SocketAddr {
        let old = self.meta.take().expect("metadata running");
        let addr = old.addr;
        old.stop().await;
        addr
    }

    /// Starts the metadata server again on `addr` with the same state.
    pub async fn start_metadata(&mut self, addr: SocketAddr) {
        self.meta =
            Some(start_meta(self.dir.path(), &addr.to_string(), self.meta_auth.as_ref()).await);
    }

    /// Restarts the metadata server with an empty state directory.
    pub async fn restart_metadata_wiped(&mut self) {
        let old = self.meta.take().expect("metadata running");
        let addr = old.addr;
        old.stop().await;
        std::fs::remove_dir_all(self.dir.path().join("meta")).expect("wipe metadata state");
        self.meta =
            Some(start_meta(self.dir.path(), &addr.to_string(), self.meta_auth.as_ref()).await);
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.store.take() {
            s.stop().await;
        }
        if let Some(m) = self.meta.take() {
            m.stop().await;
        }
    }
}

fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

async fn start_meta(dir: &Path, addr: &str, auth: Option<&kt_service::Auth>) -> Server {
    let listener = bind(addr).await;
    let addr = listener.local_addr().expect("addr");
    let shutdown = CancellationToken::new();
    let mut cfg = kt_metadata::Config::new(dir.join("meta"), Token::new(TOKEN).expect("token"));
    cfg.sweep_interval = Duration::from_millis(200);
    cfg.server.auth = auth.cloned();
    let s = shutdown.clone();
    let task = tokio::spawn(async move {
        kt_metadata::run(listener, cfg, s)
            .await
            .expect("metadata server");
    });
    Server {
        addr,
        shutdown,
        task,
    }
}

async fn start_store(
    cfg: &kt_store::Config,
    addr: &str,
) -> (Server, std::sync::Arc<kt_service::Metrics>) {
    let listener = bind(addr).await;
    let addr = listener.local_addr().expect("addr");
    let shutdown = CancellationToken::new();
    let handle = kt_store::start(listener, cfg.clone(), shutdown.clone()).expect("store");
    let metrics = handle.metrics.clone();
    let task = tokio::spawn(async move {
        handle.task.await.expect("join").expect("store server");
    });
    (
        Server {
            addr,
            shutdown,
            task,
        },
        metrics,
    )
}

/// The manifest of a tree as it is on disk (no cache), for comparisons.
pub fn fingerprint(path: &Path) -> Manifest {
    kt_sync::scan(path, &mut ScanCache::default()).expect("scan")
}

/// Writes `files` (relative path, content) under `root`, creating directories.
pub fn write_files(root: &Path, files: &[(&str, &[u8])]) {
    for (p, data) in files {
        let path = root.join(p);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(&path, data).expect("write");
    }
}

/// Deterministic pseudo-random bytes.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Puts the file or tree `src` under `key` as `token`, through the
/// metadata server at `meta_url`, naming `service` when given (else the
/// store picks it, as for any put); a fresh client whose cache is under
/// `dir` and that has no agent. The error code of a refusal, to check
/// which puts a token's rights allow.
pub async fn put_as(
    meta_url: &str,
    dir: &Path,
    token: &str,
    key: &str,
    src: &Path,
    service: Option<&str>,
) -> Result<(), Option<kt_types::ErrorCode>> {
    let mut cfg = ClientConfig::new(meta_url.to_owned(), token);
    cfg.cache_dir = Some(dir.join(format!("cache-{token}")));
    cfg.agent_socket = dir.join("no-agent.sock");
    let client = Client::new(cfg).expect("client");
    let key = kt_types::Key::parse(key).expect("key");
    let options = kt_types::api::PutOptions {
        service: service.map(str::to_owned),
        ..Default::default()
    };
    client
        .put(&key, src, options, kt_client::Progress::none())
        .await
        .map(|_| ())
        .map_err(|e| e.code())
}

/// Every path below `root`, relative, sorted (to see what a server left on disk).
pub fn listing(root: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for d in rd.flatten() {
            let p = d.path();
            out.push(p.strip_prefix(root).unwrap_or(&p).display().to_string());
            if d.file_type().is_ok_and(|t| t.is_dir()) {
                walk(root, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// A node agent in-process on `127.0.0.1:0`, with its control socket and
/// state directory under the cluster's directory; restartable on the same
/// address, socket and state.
#[derive(Debug)]
pub struct Agent {
    pub id: String,
    /// The URL it advertises (and serves the read protocol on).
    pub url: String,
    pub config: kt_agent::Config,
    pub exports: std::sync::Arc<kt_agent::exports::Exports>,
    server: Option<Server>,
}

impl Cluster {
    /// Starts a node agent named `id` that beats to this cluster's metadata server.
    pub async fn start_agent(&self, id: &str) -> Agent {
        self.start_agent_with(id, |_| {}).await
    }

    /// [`Cluster::start_agent`], its configuration adjusted by `tune`.
    pub async fn start_agent_with(
        &self,
        id: &str,
        tune: impl FnOnce(&mut kt_agent::Config),
    ) -> Agent {
        let run = self.dir.path().join(format!("agent-{id}"));
        let mut cfg = kt_agent::Config::new(
            id,
            self.metadata_url(),
            Token::new(TOKEN).expect("token"),
            run.join("agent.sock"),
        );
        // Every agent of a cluster shares one shared-memory directory (as the
        // containers of a pod do), apart from the host's /dev/shm.
        cfg.shm_dir = self.shm_dir();
        cfg.tensor_timeout = Duration::from_secs(20);
        tune(&mut cfg);
        let (server, url, exports) = start_agent_at(&cfg, "127.0.0.1:0").await;
        Agent {
            id: id.to_owned(),
            url,
            config: cfg,
            exports,
            server: Some(server),
        }
    }
}

impl Agent {
    pub fn socket(&self) -> &Path {
        &self.config.socket
    }

    /// A control connection past the hello.
    pub async fn control(&self) -> ControlClient {
        ControlClient::open(self.socket()).await
    }

    /// Stops the agent (as on SIGTERM) and starts it again on the same
    /// address, socket and state directory.
    pub async fn restart(&mut self) {
        self.restart_after(async {}).await;
    }

    /// [`Agent::restart`], with `meanwhile` run while the agent is down.
    pub async fn restart_after(&mut self, meanwhile: impl std::future::Future<Output = ()>) {
        let old = self.server.take().expect("agent running");
        let addr = old.addr;
        old.stop().await;
        meanwhile.await;
        let (server, url, exports) = start_agent_at(&self.config, &addr.to_string()).await;
        self.server = Some(server);
        self.url = url;
        self.exports = exports;
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.server.take() {
            s.stop().await;
        }
    }
}

async fn start_agent_at(
    cfg: &kt_agent::Config,
    addr: &str,
) -> (Server, String, std::sync::Arc<kt_agent::exports::Exports>) {
    let listener = bind(addr).await;
    let addr = listener.local_addr().expect("addr");
    let shutdown = CancellationToken::new();
    let handle = kt_agent::start(listener, cfg.clone(), shutdown.clone()).expect("agent");
    let (url, exports) = (handle.url.clone(), handle.exports.clone());
    let task = tokio::spawn(async move {
        handle.task.await.expect("join").expect("agent");
    });
    (
        Server {
            addr,
            shutdown,
            task,
        },
        url,
        exports,
    )
}

/// A raw client of an agent's control socket (length-prefixed JSON).
#[derive(Debug)]
pub struct ControlClient {
    stream: tokio::net::UnixStream,
}

impl ControlClient {
    pub async fn connect(socket: &Path) -> std::io::Result<Self> {
        Ok(ControlClient {
            stream: tokio::net::UnixStream::connect(socket).await?,
        })
    }

    /// A connection to the agent at `socket`, past the hello.
    pub async fn open(socket: &Path) -> ControlClient {
        let mut c = ControlClient::connect(socket)
            .await
            .expect("connect to the agent");
        let hello = c
            .ask(&kt_types::agent::ControlRequest::Hello {
                version: kt_types::agent::CONTROL_VERSION,
                keepalive: false,
            })
            .await;
        assert!(
            matches!(hello, Some(kt_types::agent::ControlReply::Hello { .. })),
            "{hello:?}"
        );
        c
    }

    /// One request, one reply; `None` when the agent closed the connection.
    pub async fn ask(
        &mut self,
        req: &kt_types::agent::ControlRequest,
    ) -> Option<kt_types::agent::ControlReply> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let frame = kt_types::agent::encode_frame(req).expect("encode");
        self.stream.write_all(&frame).await.ok()?;
        let mut head = [0u8; 4];
        self.stream.read_exact(&mut head).await.ok()?;
        let mut body = vec![0u8; kt_types::agent::frame_len(head).expect("frame length")];
        self.stream.read_exact(&mut body).await.ok()?;
        Some(serde_json::from_slice(&body).expect("a control reply"))
    }
}

/// A failed read-protocol request: its status and error body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadFailure {
    pub status: u16,
    pub code: Option<kt_types::ErrorCode>,
    pub message: String,
}

/// A failed answer, decoded the way every kt client decodes it (kt-api).
async fn failure(resp: reqwest::Response) -> ReadFailure {
    let url = resp.url().to_string();
    match kt_api::check(&url, resp).await {
        Err(kt_api::CallError::Status {
            status,
            code,
            message,
            ..
        }) => ReadFailure {
            status,
            code: Some(code),
            message,
        },
        other => panic!("not a failed answer: {other:?}"),
    }
}

/// Opens a read lease on `key` at `base` (a store or an agent).
pub async fn open_read(
    http: &reqwest::Client,
    base: &str,
    key: &str,
) -> Result<kt_types::api::ReadManifest, ReadFailure> {
    let resp = http
        .get(format!("{base}/api/v1/trees/{key}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("request");
    if !resp.status().is_success() {
        return Err(failure(resp).await);
    }
    let doc = resp.bytes().await.expect("body");
    Ok(kt_types::api::ReadManifest::from_document(&doc).expect("read manifest"))
}

/// Reads `len` bytes at `offset` of manifest entry `index` under a read lease.
pub async fn read_range(
    http: &reqwest::Client,
    base: &str,
    lease: &str,
    index: u32,
    offset: u64,
    len: u64,
) -> Result<bytes::Bytes, ReadFailure> {
    let resp = http
        .get(format!("{base}/api/v1/reads/{lease}/files/{index}"))
        .query(&[("offset", offset), ("len", len)])
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("request");
    if !resp.status().is_success() {
        return Err(failure(resp).await);
    }
    Ok(resp.bytes().await.expect("body"))
}

/// Fetches `key` from `base` over the read protocol, the way a getter does
/// (small files in one batch stream, large ones in chunk-sized ranges), into
/// `dest`, every file verified against its hash; then releases the lease.
/// Returns the read manifest.
pub async fn fetch(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    dest: &Path,
) -> Result<kt_types::api::ReadManifest, ReadFailure> {
    use kt_sync::apply::{self, WriteMode};
    use kt_types::{EntryKind, RootKind};
    let read = open_read(http, base, key).await?;
    let m = std::sync::Arc::new(read.manifest.clone());
    let path_of = |e: &kt_types::Entry| match m.root {
        RootKind::Dir => dest.join(&e.path),
        RootKind::File => dest.to_owned(),
    };
    match m.root {
        RootKind::Dir => apply::ensure_dirs(dest, &m).expect("dirs"),
        RootKind::File => std::fs::create_dir_all(dest.parent().expect("parent")).expect("mkdir"),
    }
    let mut small = std::collections::HashMap::new();
    for (i, e) in m.entries.iter().enumerate() {
        if e.kind != EntryKind::File {
            continue;
        }
        if e.size <= read.chunk_size {
            small.insert(
                i as u32,
                kt_sync::batch::Expected {
                    dest: path_of(e),
                    entry: e.clone(),
                },
            );
            continue;
        }
        let mut data = Vec::with_capacity(e.size as usize);
        let mut offset = 0;
        while offset < e.size {
            let len = read.chunk_size.min(e.size - offset);
            let part = read_range(http, base, &read.lease, i as u32, offset, len).await?;
            data.extend_from_slice(&part);
            offset += len;
        }
        apply::write_verified(&path_of(e), e, &data, WriteMode::Direct).map_err(|err| {
            ReadFailure {
                status: 0,
                code: None,
                message: err.to_string(),
            }
        })?;
    }
    if !small.is_empty() {
        let mut indices: Vec<u32> = small.keys().copied().collect();
        indices.sort_unstable();
        let resp = http
            .post(format!("{base}/api/v1/reads/{}/batch", read.lease))
            .json(&kt_types::api::BatchRequest { indices })
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("request");
        if !resp.status().is_success() {
            return Err(failure(resp).await);
        }
        kt_sync::batch::receive_stream(
            Box::pin(resp.bytes_stream()),
            std::sync::Arc::new(small),
            WriteMode::Direct,
            None,
        )
        .await
        .map_err(|err| ReadFailure {
            status: 0,
            code: None,
            message: err.to_string(),
        })?;
    }
    if m.root == RootKind::Dir {
        apply::finish_tree(dest, &m).expect("finish tree");
    }
    let released = http
        .delete(format!("{base}/api/v1/reads/{}", read.lease))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("request");
    assert!(released.status().is_success(), "releasing the lease");
    Ok(read)
}

/// A progress sink counting the bytes a transfer reports done (`.0`), for
/// tests that act once a transfer is partway.
#[derive(Debug, Default)]
struct BytesDone(std::sync::atomic::AtomicUsize);

impl kt_client::progress::ProgressSink for BytesDone {
    fn start(&self, _bytes: u64, _files: u64) {}
    fn advance(&self, bytes: u64) {
        self.0
            .fetch_add(bytes as usize, std::sync::atomic::Ordering::SeqCst);
    }
    fn finish(&self) {}
}
