//! The store's side of the metadata server: announce the store, register
//! published keys, and remember which could not be registered (the retries
//! themselves are [`crate::reconcile`], which knows the keys).

use std::collections::HashSet;
use std::time::Duration;

use kt_api::{Api, Backoff, CallError};
use kt_service::Token;
use kt_types::api::{RegisterIf, RegisterKey, RegisterStore};
use kt_types::{Key, KeyRecord, paths};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

#[derive(Debug)]
pub struct Registrar {
    meta: Api,
    store_url: String,
    /// Keys whose last registration failed. Only the key: a retry registers
    /// whatever the store holds then, never an older version.
    pending: Mutex<HashSet<Key>>,
}

impl Registrar {
    pub fn new(metadata_url: &str, store_url: &str, token: Token) -> Result<Self, String> {
        let http = kt_api::tls::http_builder()
            .map_err(|e| e.to_string())?
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Registrar {
            meta: Api::new(http, metadata_url, token.credential()),
            store_url: store_url.to_owned(),
            pending: Mutex::new(HashSet::new()),
        })
    }

    async fn announce(&self) -> Result<(), CallError> {
        self.meta
            .post(&paths::stores())
            .json(&RegisterStore {
                url: self.store_url.clone(),
            })
            .ok()
            .await
    }

    /// Announces the store, retrying with backoff and jitter until it works
    /// or shutdown.
    pub async fn announce_until_ok(&self, shutdown: &CancellationToken) {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(5));
        loop {
            match self.announce().await {
                Ok(()) => {
                    tracing::info!(metadata = %self.meta.base(), "registered with the metadata server");
                    return;
                }
                Err(e) => tracing::warn!(error = %e, "metadata server not reachable yet"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = backoff.wait() => {}
            }
        }
    }

    /// Records a published version (called under the key's lock, so records
    /// follow publish order). Unconditional: the latest put wins. On failure
    /// the key is kept for [`crate::reconcile::retry_pending`].
    pub async fn register(&self, key: &Key, reg: RegisterKey) -> Result<KeyRecord, CallError> {
        let sent = self.send(key, &reg).await;
        let mut pending = self.pending.lock().await;
        match sent {
            Ok(_) => pending.remove(key),
            Err(_) => pending.insert(key.clone()),
        };
        sent
    }

    /// Registers `reg` only if the metadata server has no record of the key
    /// (and did not delete it recently) or one the store holds: a late
    /// registration never undoes a `locale=local` put or a delete that came
    /// after it ([`RegisterIf::AbsentOrHeld`]).
    pub async fn register_if_unchanged(
        &self,
        key: &Key,
        reg: RegisterKey,
    ) -> Result<KeyRecord, CallError> {
        let reg = RegisterKey {
            only_if: Some(RegisterIf::AbsentOrHeld),
            ..reg
        };
        self.send(key, &reg).await
    }

    /// The metadata server's record of `key`.
    pub async fn record(&self, key: &Key) -> Result<KeyRecord, CallError> {
        self.meta.get(&paths::key(key)).fetch().await
    }

    /// Which service may write `key`, as the metadata server has it.
    pub async fn owner(&self, key: &Key) -> Result<kt_types::api::KeyOwner, CallError> {
        self.meta.get(&paths::owner(key)).fetch().await
    }

    /// Keys whose registration failed, to retry.
    pub async fn pending(&self) -> Vec<Key> {
        self.pending.lock().await.iter().cloned().collect()
    }

    /// Marks a key for retry.
    pub async fn mark_pending(&self, key: &Key) {
        self.pending.lock().await.insert(key.clone());
    }

    /// Forgets a pending registration (recorded, or the key is gone).
    pub async fn forget(&self, key: &Key) {
        self.pending.lock().await.remove(key);
    }

    async fn send(&self, key: &Key, reg: &RegisterKey) -> Result<KeyRecord, CallError> {
        self.meta.put(&paths::key(key)).json(reg).fetch().await
    }
}

/// The metadata server's record says which service owns a key the store
/// holds (asked before serving it to a token that reads only some).
impl kt_service::reads::Owners for Registrar {
    fn service_of<'a>(
        &'a self,
        key: &'a Key,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<String, kt_service::ApiError>> + Send + 'a>,
    > {
        Box::pin(async move {
            self.record(key).await.map(|r| r.service).map_err(|e| {
                let upstream = format!("asking the metadata server which service owns {key}");
                kt_service::ApiError::from_call(e, &upstream, kt_types::ErrorCode::Unavailable)
            })
        })
    }
}
