//! In-process kt servers (metadata and store on 127.0.0.1:0) and a client.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kt_client::{Client, ClientConfig, GetSummary, Progress, PutSummary};
use kt_service::Token;
use kt_types::Key;
use kt_types::api::PutOptions;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};

const TOKEN: &str = "bench";

/// How long the store may take to register with the metadata server.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(30);

/// A metadata server, a store and a client, all in this process. The servers
/// are told to stop when this is dropped.
#[derive(Debug)]
pub struct KtCluster {
    client: Client,
    metadata_url: String,
    cache_dir: PathBuf,
    shutdown: CancellationToken,
    _stop_on_drop: DropGuard,
    metadata: JoinHandle<Result<(), kt_metadata::MetadataError>>,
    store: JoinHandle<Result<(), kt_store::StoreError>>,
}

impl KtCluster {
    /// Starts both servers with their state under `work` and waits until the
    /// store is registered with the metadata server.
    /// With `tls` (a certificate and key for 127.0.0.1), both serve HTTPS
    /// (the client trusts `KT_CA_FILE`).
    pub async fn start(work: &Path, tls: Option<&(PathBuf, PathBuf)>) -> anyhow::Result<Self> {
        let tls = tls
            .map(|(c, k)| kt_service::tls::Tls::load(c, k))
            .transpose()?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let token = Token::new(TOKEN)?;
        let shutdown = CancellationToken::new();
        let stop_on_drop = shutdown.clone().drop_guard();

        let meta_listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the metadata server")?;
        let metadata_url = format!("{scheme}://{}", meta_listener.local_addr()?);
        let mut meta = kt_metadata::Config::new(work.join("metadata"), token.clone());
        meta.server.tls = tls.clone();
        let metadata = tokio::spawn(kt_metadata::run(meta_listener, meta, shutdown.clone()));

        let store_listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the store")?;
        let mut store = kt_store::Config::new(work.join("store"), metadata_url.clone(), token);
        store.server.tls = tls;
        let store = kt_store::start(store_listener, store, shutdown.clone())
            .context("starting the store")?
            .task;

        let cache_dir = work.join("client-cache");
        let mut cfg = ClientConfig::new(metadata_url.clone(), TOKEN);
        cfg.cache_dir = Some(cache_dir.clone());
        // Transfers only: no node agent takes the copies.
        cfg.serve_copies = false;
        let client = Client::new(cfg)?;
        let cluster = KtCluster {
            client,
            metadata_url,
            cache_dir,
            shutdown,
            _stop_on_drop: stop_on_drop,
            metadata,
            store,
        };
        cluster.wait_registered().await?;
        Ok(cluster)
    }

    async fn wait_registered(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + REGISTER_TIMEOUT;
        loop {
            let last = match self.client.store_url().await {
                Ok(_) => return Ok(()),
                Err(e) => e,
            };
            if self.metadata.is_finished() || self.store.is_finished() {
                bail!("a kt server stopped during start-up (last error: {last})");
            }
            if Instant::now() >= deadline {
                bail!(
                    "the store did not register with the metadata server within \
                     {REGISTER_TIMEOUT:?}: {last}"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The metadata server's URL, for clients in other processes.
    pub fn metadata_url(&self) -> &str {
        &self.metadata_url
    }

    /// Puts `src` under `key` with default options; returns the wall time of the put.
    pub async fn put(&self, key: &str, src: &Path) -> anyhow::Result<(Duration, PutSummary)> {
        let key = Key::parse(key)?;
        let started = Instant::now();
        let summary = self
            .client
            .put(&key, src, PutOptions::default(), Progress::none())
            .await
            .with_context(|| format!("kt put {key} {}", src.display()))?;
        Ok((started.elapsed(), summary))
    }

    /// Gets `key` into `dest` (no node agent takes a copy).
    pub async fn get(&self, key: &str, dest: &Path) -> anyhow::Result<GetSummary> {
        let key = Key::parse(key)?;
        self.client
            .get(&key, dest, Progress::none())
            .await
            .with_context(|| format!("kt get {key} {}", dest.display()))
    }

    pub async fn rm(&self, key: &str) -> anyhow::Result<()> {
        let key = Key::parse(key)?;
        self.client
            .rm(&key, false)
            .await
            .with_context(|| format!("kt rm {key}"))?;
        Ok(())
    }

    /// Forgets every scan cache, so the next put hashes its whole source.
    pub fn clear_scan_cache(&self) -> anyhow::Result<()> {
        crate::scratch::recreate_dir(&self.cache_dir)
    }

    /// Stops both servers and reports their errors.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        let meta = self.metadata.await.context("metadata server task")?;
        let store = self.store.await.context("store task")?;
        meta.context("metadata server")?;
        store.context("store")?;
        Ok(())
    }
}
