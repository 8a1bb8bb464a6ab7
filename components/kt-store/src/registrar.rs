//! The store's side of the metadata server: announce the store, register
//! published keys, and retry what could not be registered.

use std::collections::HashMap;
use std::time::Duration;

use kt_api::{Api, Backoff, CallError};
use kt_service::Token;
use kt_types::api::{RegisterKey, RegisterStore};
use kt_types::{Key, KeyRecord, paths};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

#[derive(Debug)]
pub struct Registrar {
    meta: Api,
    store_url: String,
    pending: Mutex<HashMap<Key, RegisterKey>>,
}

impl Registrar {
    pub fn new(metadata_url: &str, store_url: &str, token: Token) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Registrar {
            meta: Api::new(http, metadata_url, token.expose()),
            store_url: store_url.to_owned(),
            pending: Mutex::new(HashMap::new()),
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

    /// Records a published version; on failure it is kept for retry.
    pub async fn register(&self, key: &Key, reg: RegisterKey) -> Result<KeyRecord, CallError> {
        match self.send(key, &reg).await {
            Ok(r) => {
                self.pending.lock().await.remove(key);
                Ok(r)
            }
            Err(e) => {
                self.pending.lock().await.insert(key.clone(), reg);
                Err(e)
            }
        }
    }

    /// Forgets a pending registration (the key was deleted).
    pub async fn forget(&self, key: &Key) {
        self.pending.lock().await.remove(key);
    }

    async fn send(&self, key: &Key, reg: &RegisterKey) -> Result<KeyRecord, CallError> {
        self.meta.put(&paths::key(key)).json(reg).fetch().await
    }

    /// Registers keys the metadata server lacks or knows at another version.
    pub async fn reconcile(&self, keys: Vec<(Key, RegisterKey)>) {
        for (key, reg) in keys {
            let known: Result<KeyRecord, _> = self.meta.get(&paths::key(&key)).fetch().await;
            // Up to date, or superseded by a `locale=local` put (the key
            // now belongs to a pod's agent, not to us): nothing to do.
            let up_to_date = known.is_ok_and(|rec| {
                rec.holder != kt_types::STORE_HOLDER
                    || (rec.version == reg.version && rec.source == reg.source)
            });
            if !up_to_date && let Err(e) = self.register(&key, reg).await {
                tracing::warn!(%key, error = %e, "could not register key; will retry");
            }
        }
    }

    /// Retries registrations that failed earlier.
    pub async fn retry_pending(&self) {
        let pending: Vec<(Key, RegisterKey)> = self
            .pending
            .lock()
            .await
            .iter()
            .map(|(k, r)| (k.clone(), r.clone()))
            .collect();
        for (key, reg) in pending {
            if self.register(&key, reg).await.is_ok() {
                tracing::info!(%key, "pending registration recorded");
            }
        }
    }
}
