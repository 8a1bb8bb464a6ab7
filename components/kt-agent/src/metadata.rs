//! The agent's client of the metadata server: registering and unregistering
//! keys, key lookups, quorum joins, rendezvous and done reports, heartbeats
//! (the loop that sends them is in `heartbeat`).

use std::time::Duration;

use kt_service::{ApiError, Token};
use kt_types::api::{AgentHeartbeat, HeartbeatReply, RegisterKey};
use kt_types::tensor::{QuorumDone, QuorumJoin, QuorumPlan, QuorumStatus, Rendezvous};
use kt_types::{ErrorBody, ErrorCode, Key, KeyRecord};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A client of the metadata server's agent-facing API.
#[derive(Debug)]
pub struct MetadataClient {
    http: reqwest::Client,
    base: String,
    token: Token,
}

impl MetadataClient {
    pub fn new(base: &str, token: Token, timeout: Duration) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| e.to_string())?;
        Ok(MetadataClient {
            http,
            base: base.trim_end_matches('/').to_owned(),
            token,
        })
    }

    async fn send<T: DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: &impl Serialize,
    ) -> Result<T, ApiError> {
        self.call(method, path, Some(body), None).await
    }

    /// One request: `body` as JSON when given; `timeout` instead of the
    /// client's (long polls).
    async fn call<T: DeserializeOwned, B: Serialize>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&B>,
        timeout: Option<Duration>,
    ) -> Result<T, ApiError> {
        let url = format!("{}{path}", self.base);
        let mut req = self
            .http
            .request(method, &url)
            .bearer_auth(self.token.expose());
        if let Some(b) = body {
            req = req.json(b);
        }
        if let Some(t) = timeout {
            req = req.timeout(t);
        }
        let resp = req.send().await.map_err(|e| {
            ApiError::new(
                ErrorCode::Unavailable,
                format!("metadata server unreachable ({url}): {e}"),
            )
        })?;
        let status = resp.status();
        if status.is_success() {
            return resp.json().await.map_err(|e| {
                ApiError::new(
                    ErrorCode::Unavailable,
                    format!("unreadable answer from the metadata server ({url}): {e}"),
                )
            });
        }
        let text = resp.text().await.unwrap_or_default();
        Err(match serde_json::from_str::<ErrorBody>(&text) {
            Ok(b) => ApiError::new(
                b.error.code,
                format!("metadata server: {}", b.error.message),
            ),
            Err(_) => ApiError::new(
                ErrorCode::Unavailable,
                format!("metadata server answered {status} ({url}): {text}"),
            ),
        })
    }

    /// `PUT /api/v1/keys/{key}`: records a local put with this agent as holder.
    pub async fn register(&self, key: &Key, reg: &RegisterKey) -> Result<KeyRecord, ApiError> {
        self.send(reqwest::Method::PUT, &format!("/api/v1/keys/{key}"), reg)
            .await
    }

    /// `GET /api/v1/keys/{key}`.
    pub async fn key(&self, key: &Key) -> Result<KeyRecord, ApiError> {
        self.call::<_, ()>(
            reqwest::Method::GET,
            &format!("/api/v1/keys/{key}"),
            None,
            None,
        )
        .await
    }

    /// `DELETE /api/v1/keys/{key}?version=V`: only that version (a key put
    /// again since is left alone).
    pub async fn unregister(&self, key: &Key, version: &str) -> Result<(), ApiError> {
        let path = format!("/api/v1/keys/{key}?version={}", query_value(version));
        self.call::<serde_json::Value, ()>(reqwest::Method::DELETE, &path, None, None)
            .await
            .map(drop)
    }

    /// `POST /api/v1/quorums/{group}/join`: answered when the quorum closes.
    pub async fn quorum_join(
        &self,
        group: &str,
        join: &QuorumJoin,
        wait: Duration,
    ) -> Result<QuorumPlan, ApiError> {
        let path = format!("/api/v1/quorums/{group}/join");
        self.call(reqwest::Method::POST, &path, Some(join), Some(wait))
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
        let path = format!("/api/v1/quorums/{group}/{transfer}/rendezvous");
        match publish {
            Some(r) => {
                self.call::<serde_json::Value, _>(reqwest::Method::PUT, &path, Some(r), None)
                    .await?;
                Ok(r.clone())
            }
            None => {
                let path = format!("{path}?wait_ms={}", wait.as_millis());
                self.call::<_, ()>(
                    reqwest::Method::GET,
                    &path,
                    None,
                    Some(wait + Duration::from_secs(10)),
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
        let path = format!("/api/v1/quorums/{group}/{transfer}/done");
        self.send(reqwest::Method::POST, &path, done).await
    }

    /// `POST /api/v1/agents`.
    pub async fn heartbeat(&self, beat: &AgentHeartbeat) -> Result<HeartbeatReply, ApiError> {
        self.send(reqwest::Method::POST, "/api/v1/agents", beat)
            .await
    }
}

/// Percent-encodes a query value (everything but unreserved characters).
fn query_value(v: &str) -> String {
    v.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
