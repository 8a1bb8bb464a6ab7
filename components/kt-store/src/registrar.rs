//! The store's side of the metadata server: announce the store, register
//! published keys, and retry what could not be registered.

use std::collections::HashMap;
use std::time::Duration;

use kt_service::Token;
use kt_types::api::{RegisterKey, RegisterStore};
use kt_types::{ErrorBody, Key, KeyRecord};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

#[derive(Debug)]
pub struct Registrar {
    http: reqwest::Client,
    metadata_url: String,
    store_url: String,
    token: Token,
    pending: Mutex<HashMap<Key, RegisterKey>>,
}

async fn error_text(resp: reqwest::Response) -> String {
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    match serde_json::from_str::<ErrorBody>(&text) {
        Ok(b) => format!("{status}: {}", b.error.message),
        Err(_) => format!("{status}: {text}"),
    }
}

impl Registrar {
    pub fn new(metadata_url: &str, store_url: &str, token: Token) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Registrar {
            http,
            metadata_url: metadata_url.trim_end_matches('/').to_owned(),
            store_url: store_url.to_owned(),
            token,
            pending: Mutex::new(HashMap::new()),
        })
    }

    async fn announce(&self) -> Result<(), String> {
        let resp = self
            .http
            .post(format!("{}/api/v1/stores", self.metadata_url))
            .bearer_auth(self.token.expose())
            .json(&RegisterStore {
                url: self.store_url.clone(),
            })
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if resp.status().is_success() {
            Ok(())
        } else {
            Err(error_text(resp).await)
        }
    }

    /// Announces the store, retrying with backoff until it works or shutdown.
    pub async fn announce_until_ok(&self, shutdown: &CancellationToken) {
        let mut wait = Duration::from_millis(50);
        loop {
            match self.announce().await {
                Ok(()) => {
                    tracing::info!(metadata = %self.metadata_url, "registered with the metadata server");
                    return;
                }
                Err(e) => tracing::warn!(error = %e, "metadata server not reachable yet"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            wait = (wait * 2).min(Duration::from_secs(5));
        }
    }

    /// Records a published version; on failure it is kept for retry.
    pub async fn register(&self, key: &Key, reg: RegisterKey) -> Result<KeyRecord, String> {
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

    async fn send(&self, key: &Key, reg: &RegisterKey) -> Result<KeyRecord, String> {
        let resp = self
            .http
            .put(format!("{}/api/v1/keys/{key}", self.metadata_url))
            .bearer_auth(self.token.expose())
            .json(reg)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if resp.status().is_success() {
            resp.json().await.map_err(|e| e.to_string())
        } else {
            Err(error_text(resp).await)
        }
    }

    /// Registers keys the metadata server lacks or knows at another version.
    pub async fn reconcile(&self, keys: Vec<(Key, RegisterKey)>) {
        for (key, reg) in keys {
            let known = self
                .http
                .get(format!("{}/api/v1/keys/{key}", self.metadata_url))
                .bearer_auth(self.token.expose())
                .send()
                .await;
            // Up to date, or superseded by a `locale=local` put (the key
            // now belongs to a pod's agent, not to us): nothing to do.
            let up_to_date = match known {
                Ok(r) if r.status().is_success() => r.json::<KeyRecord>().await.is_ok_and(|rec| {
                    rec.holder != kt_types::STORE_HOLDER
                        || (rec.version == reg.version && rec.source == reg.source)
                }),
                _ => false,
            };
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
