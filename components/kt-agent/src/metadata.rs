//! The agent's client of the metadata server: registering and unregistering
//! keys, key lookups, quorum joins, rendezvous and done reports, heartbeats
//! (the loop that sends them is in `heartbeat`).

use std::time::Duration;

use kt_api::{Api, Call, CallError};
use kt_service::{ApiError, Token};
use kt_types::api::{AgentHeartbeat, HeartbeatReply, RegisterKey};
use kt_types::tensor::{
    QuorumDone, QuorumJoin, QuorumPlan, QuorumStatus, Rendezvous, TensorGrant, TensorGrantRequest,
};
use kt_types::{ErrorCode, Key, KeyRecord, paths};
use serde::de::DeserializeOwned;

/// How many more times a registration is sent while the metadata server is
/// away: with kt-api's backoff (50 ms doubling to 2 s, jittered) about 4 to
/// 7 seconds in all, a metadata pod's restart.
pub const REGISTER_RETRIES: u32 = 8;

/// A client of the metadata server's agent-facing API.
#[derive(Debug)]
pub struct MetadataClient {
    api: Api,
}

/// A failed call, as the agent answers it on ([`ApiError::from_call`]):
/// the metadata server away is `unavailable` (it is needed again); its
/// own answer keeps its code.
fn meta_err(e: CallError) -> ApiError {
    ApiError::from_call(e, "metadata server", ErrorCode::Unavailable)
}

async fn fetch<T: DeserializeOwned>(call: Call) -> Result<T, ApiError> {
    call.fetch().await.map_err(meta_err)
}

async fn ok(call: Call) -> Result<(), ApiError> {
    call.ok().await.map_err(meta_err)
}

impl MetadataClient {
    pub fn new(base: &str, token: Token, timeout: Duration) -> Result<Self, String> {
        let http = kt_api::tls::http_builder()
            .map_err(|e| e.to_string())?
            .timeout(timeout)
            .build()
            .map_err(|e| e.to_string())?;
        Ok(MetadataClient {
            api: Api::new(http, base, token.credential()),
        })
    }

    /// `PUT /api/v1/keys/{key}`: records a local put with this agent as
    /// holder. A metadata server away (restarting: refused connections, or
    /// 503 `unavailable` from a proxy) is tried again with backoff for
    /// [`REGISTER_RETRIES`] more times, a few seconds: the put waits through
    /// a restart rather than failing. Safe to repeat: registering the same
    /// version again records the same thing.
    pub async fn register(&self, key: &Key, reg: &RegisterKey) -> Result<KeyRecord, ApiError> {
        fetch(
            self.api
                .put(&paths::key(key))
                .json(reg)
                .retry(REGISTER_RETRIES),
        )
        .await
    }

    /// `GET /api/v1/keys/{key}`.
    pub async fn key(&self, key: &Key) -> Result<KeyRecord, ApiError> {
        fetch(self.api.get(&paths::key(key))).await
    }

    /// `POST /api/v1/tensors/grants/{key}`: a key of tensors' record and
    /// the capability this agent (`getter`) shows its holder.
    pub async fn tensor_grant(&self, key: &Key, getter: &str) -> Result<TensorGrant, ApiError> {
        let req = TensorGrantRequest {
            getter: getter.to_owned(),
        };
        fetch(self.api.post(&paths::tensor_grant(key)).json(&req)).await
    }

    /// `DELETE /api/v1/keys/{key}?version=V`: only that version (a key put
    /// again since is left alone).
    pub async fn unregister(&self, key: &Key, version: &str) -> Result<(), ApiError> {
        ok(self.api.delete(&paths::key_version(key, version))).await
    }

    /// `POST /api/v1/quorums/{group}/join`: answered when the quorum closes.
    pub async fn quorum_join(
        &self,
        group: &str,
        join: &QuorumJoin,
        wait: Duration,
    ) -> Result<QuorumPlan, ApiError> {
        fetch(
            self.api
                .post(&paths::quorum_join(group))
                .json(join)
                .timeout(wait),
        )
        .await
    }

    /// `PUT` (rank 0) or `GET` (the others, long-polled) of a transfer's rendezvous.
    pub async fn rendezvous(
        &self,
        group: &str,
        transfer: &str,
        publish: Option<&Rendezvous>,
        wait: Duration,
    ) -> Result<Rendezvous, ApiError> {
        let path = paths::quorum_rendezvous(group, transfer);
        match publish {
            Some(r) => {
                ok(self.api.put(&path).json(r)).await?;
                Ok(r.clone())
            }
            None => {
                fetch(
                    self.api
                        .get(&path)
                        .query(&[("wait_ms", wait.as_millis() as u64)])
                        .timeout(wait + Duration::from_secs(10)),
                )
                .await
            }
        }
    }

    /// `POST /api/v1/quorums/{group}/{transfer}/done`.
    pub async fn quorum_done(
        &self,
        group: &str,
        transfer: &str,
        done: &QuorumDone,
    ) -> Result<QuorumStatus, ApiError> {
        fetch(
            self.api
                .post(&paths::quorum_done(group, transfer))
                .json(done),
        )
        .await
    }

    /// `POST /api/v1/agents`.
    pub async fn heartbeat(&self, beat: &AgentHeartbeat) -> Result<HeartbeatReply, ApiError> {
        fetch(self.api.post(&paths::agents()).json(beat)).await
    }
}

/// The metadata server's record says which service owns a key this agent
/// serves (asked before serving it to a token that reads only some).
impl kt_service::reads::Owners for MetadataClient {
    fn service_of<'a>(
        &'a self,
        key: &'a Key,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<String, ApiError>> + Send + 'a>>
    {
        Box::pin(async move { Ok(self.key(key).await?.service) })
    }
}
