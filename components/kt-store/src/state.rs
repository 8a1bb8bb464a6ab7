//! What every handler shares: the configuration and the state of the
//! running store. Handler modules (`put`, `trees`) depend on this, never on
//! the composition root (`server`) or on each other.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kt_service::cli::ServerConfig;
use kt_service::reads::Reads;
use kt_service::{ApiError, Metrics};
use kt_types::api::RegisterKey;
use kt_types::manifest::ManifestLimits;
use kt_types::{Key, Locale, RootKind};

use crate::keys::{KeyState, Keys, Published};
use crate::registrar::Registrar;
use crate::session::Sessions;
use crate::versions::StoreVersions;

/// Everything the store needs besides its listener.
#[derive(Debug, Clone)]
pub struct Config {
    pub data_dir: PathBuf,
    pub metadata_url: String,
    /// URL under which other components reach this store; defaults to the listen address.
    pub advertise_url: Option<String>,
    /// What every server takes from the shared flags
    /// ([`kt_service::cli::ServerArgs::load`]): its token, who may call it,
    /// TLS, requests served at once.
    pub server: ServerConfig,
    /// Files larger than this are moved in chunks of this size (power of two).
    pub chunk_size: u64,
    /// Largest request body held in memory (a put plan carries the whole
    /// manifest: 64 MiB is a tree of about 600,000 files), and what all
    /// bodies held at once may add up to ([`kt_service::BodyBudget`]).
    pub max_request_bytes: usize,
    pub limits: ManifestLimits,
    /// Idle read leases and upload sessions are dropped after these.
    pub lease_ttl: Duration,
    pub session_ttl: Duration,
    /// How long in-flight requests may finish after shutdown is requested.
    pub drain: Duration,
    /// Bytes of the data volume no put may take; `None`: 2% of it, at most
    /// 1 GiB.
    pub reserve: Option<u64>,
}

impl Config {
    pub fn new(
        data_dir: impl Into<PathBuf>,
        metadata_url: impl Into<String>,
        server: impl Into<ServerConfig>,
    ) -> Self {
        Config {
            data_dir: data_dir.into(),
            metadata_url: metadata_url.into(),
            advertise_url: None,
            server: server.into(),
            chunk_size: kt_sync::defaults::CHUNK_SIZE,
            max_request_bytes: 64 << 20,
            limits: ManifestLimits::default(),
            lease_ttl: Duration::from_secs(300),
            session_ttl: Duration::from_secs(600),
            reserve: None,
            drain: Duration::from_secs(10),
        }
    }
}

/// State shared by every handler.
#[derive(Debug)]
pub struct Shared {
    pub cfg: Config,
    pub keys: Arc<Keys>,
    pub puts: Sessions,
    /// Read leases over [`StoreVersions`] (the shared read protocol).
    pub reads: Arc<Reads<StoreVersions>>,
    pub metrics: Arc<Metrics>,
    pub registrar: Arc<Registrar>,
    pub url: String,
}

impl Shared {
    /// The registration a published version makes with the metadata server.
    pub fn registration(&self, p: &Published) -> RegisterKey {
        let m = &p.meta.manifest;
        RegisterKey {
            holder: None,
            locale: Locale::Store,
            source: self.url.clone(),
            version: p.version.clone(),
            is_dir: m.root == RootKind::Dir,
            size: m.total_bytes(),
            files: m.file_count(),
            tensors: None,
            // Of the manifest this store serves for the version.
            digest: Some(p.digest),
            options: p.meta.options.clone(),
            only_if: None,
        }
    }

    /// Removes a key and all its versions (with its state locked, `st`).
    /// Readers of it fail; pending registrations of it are dropped.
    pub async fn remove_key(&self, key: &Key, st: &mut KeyState) -> Result<(), ApiError> {
        let dir = self.keys.dir_of(key);
        blocking(move || dir.remove_all()).await?;
        st.current = None;
        st.spare = None;
        self.keys.forget(key);
        self.registrar.forget(key).await;
        Ok(())
    }
}

pub type AppState = Arc<Shared>;

pub use kt_service::{blocking, sync_err};
