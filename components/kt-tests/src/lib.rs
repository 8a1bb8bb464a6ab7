//! Test harness: real metadata and store servers on `127.0.0.1:0`, in-process,
//! with the real client; helpers to build trees and compare them.

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
        let dir = tempfile::tempdir().expect("tempdir");
        let meta = start_meta(dir.path(), "127.0.0.1:0").await;
        let mut cfg = kt_store::Config::new(
            dir.path().join("store"),
            format!("http://{}", meta.addr),
            Token::new(TOKEN).expect("token"),
        );
        cfg.chunk_size = CHUNK;
        tune(&mut cfg);
        let (store, metrics) = start_store(&cfg, "127.0.0.1:0").await;
        let c = Cluster {
            dir,
            meta: Some(meta),
            store: Some(store),
            store_metrics: metrics,
            store_config: cfg,
        };
        c.wait_ready().await;
        c
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
        let mut cfg = ClientConfig::new(self.metadata_url(), TOKEN);
        cfg.cache_dir = Some(self.dir.path().join(format!("cache-{}", uuid_like())));
        Client::new(cfg).expect("client")
    }

    pub async fn wait_ready(&self) {
        let http = reqwest::Client::new();
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
        let old = self.store.take().expect("store running");
        let addr = old.addr;
        old.stop().await;
        let (store, metrics) = start_store(&self.store_config, &addr.to_string()).await;
        self.store = Some(store);
        self.store_metrics = metrics;
        self.wait_ready().await;
    }

    pub async fn restart_metadata(&mut self) {
        let old = self.meta.take().expect("metadata running");
        let addr = old.addr;
        old.stop().await;
        self.meta = Some(start_meta(self.dir.path(), &addr.to_string()).await);
    }

    /// Restarts the metadata server with an empty state directory.
    pub async fn restart_metadata_wiped(&mut self) {
        let old = self.meta.take().expect("metadata running");
        let addr = old.addr;
        old.stop().await;
        std::fs::remove_dir_all(self.dir.path().join("meta")).expect("wipe metadata state");
        self.meta = Some(start_meta(self.dir.path(), &addr.to_string()).await);
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

async fn start_meta(dir: &Path, addr: &str) -> Server {
    let listener = bind(addr).await;
    let addr = listener.local_addr().expect("addr");
    let shutdown = CancellationToken::new();
    let mut cfg = kt_metadata::Config::new(dir.join("meta"), Token::new(TOKEN).expect("token"));
    cfg.sweep_interval = Duration::from_millis(200);
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
