//! The HTTP client: metadata calls and the store's sync protocol endpoints.

use std::path::PathBuf;
use std::time::Duration;

use kt_types::api::{DeleteResponse, ListResponse, StoreLocation, TeardownResponse};
use kt_types::{ErrorBody, ErrorCode, Key, KeyPrefix, KeyRecord};
use serde::de::DeserializeOwned;

use crate::error::ClientError;

/// How a client reaches kt and moves data.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub metadata_url: String,
    pub token: String,
    /// Parallel streams per transfer (batches and chunks in flight).
    pub streams: usize,
    /// Where scan caches live (one file per source tree); `None` disables caching.
    pub cache_dir: Option<PathBuf>,
    /// This pod's node agent control socket.
    pub agent_socket: PathBuf,
    /// After a get, have the node agent serve the copy to other getters
    /// (every getter becomes a source). Needs a running agent; one is
    /// started on demand inside a pod (`KT_POD_IP` set).
    pub serve_copies: bool,
    pub timeout: Duration,
}

impl ClientConfig {
    pub fn new(metadata_url: impl Into<String>, token: impl Into<String>) -> Self {
        ClientConfig {
            metadata_url: metadata_url.into().trim_end_matches('/').to_owned(),
            token: token.into(),
            streams: kt_sync::defaults::STREAMS,
            cache_dir: default_cache_dir(),
            agent_socket: crate::agent::default_socket(),
            serve_copies: true,
            timeout: Duration::from_secs(3600),
        }
    }
}

/// `$XDG_CACHE_HOME/kt` or `~/.cache/kt`.
pub fn default_cache_dir() -> Option<PathBuf> {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|d| d.join("kt"))
}

/// Rewrites the URL of a server the metadata server names (the store, a
/// key's source, a broadcast parent) before the client uses it. `kt --kube`
/// maps in-cluster addresses to local port-forwards this way.
pub trait UrlMap: Send + Sync + std::fmt::Debug {
    /// The URL to use for `url`, or why it cannot be reached.
    fn map(&self, url: &str) -> Result<String, String>;
}

#[derive(Debug, Clone)]
pub struct Client {
    pub(crate) http: reqwest::Client,
    pub(crate) cfg: ClientConfig,
    url_map: Option<std::sync::Arc<dyn UrlMap>>,
}

pub(crate) async fn check(
    url: &str,
    resp: reqwest::Response,
) -> Result<reqwest::Response, ClientError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let text = resp.text().await.unwrap_or_default();
    Err(match serde_json::from_str::<ErrorBody>(&text) {
        Ok(b) => ClientError::Api {
            status: status.as_u16(),
            code: b.error.code,
            message: b.error.message,
        },
        Err(_) => ClientError::Api {
            status: status.as_u16(),
            code: if status.as_u16() == 401 {
                ErrorCode::Unauthorized
            } else {
                ErrorCode::Internal
            },
            message: format!("{url}: {}", text.trim()),
        },
    })
}

impl Client {
    pub fn new(cfg: ClientConfig) -> Result<Self, ClientError> {
        let http = reqwest::Client::builder()
            .timeout(cfg.timeout)
            .connect_timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(cfg.streams.max(1) * 2)
            .build()
            .map_err(|e| ClientError::Local(format!("http client: {e}")))?;
        Ok(Client {
            http,
            cfg,
            url_map: None,
        })
    }

    /// This client, with every server URL the metadata server names passed
    /// through `map` first.
    pub fn with_url_map(mut self, map: std::sync::Arc<dyn UrlMap>) -> Self {
        self.url_map = Some(map);
        self
    }

    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }

    /// `url` through the [`UrlMap`], if any; a URL it cannot map is an
    /// unavailable source (so a get fails over to another one).
    pub(crate) fn map_url(&self, url: &str) -> Result<String, ClientError> {
        match &self.url_map {
            None => Ok(url.to_owned()),
            Some(m) => m.map(url).map_err(|why| ClientError::Api {
                status: 503,
                code: ErrorCode::Unavailable,
                message: format!("{url} is unreachable from here: {why}"),
            }),
        }
    }

    pub(crate) fn meta(&self, path: &str) -> String {
        format!("{}/api/v1/{path}", self.cfg.metadata_url)
    }

    pub(crate) async fn send(
        &self,
        url: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, ClientError> {
        let resp = req
            .bearer_auth(&self.cfg.token)
            .send()
            .await
            .map_err(|source| ClientError::Http {
                url: url.to_owned(),
                source,
            })?;
        check(url, resp).await
    }

    /// A whole response body.
    pub(crate) async fn bytes(
        &self,
        url: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<bytes::Bytes, ClientError> {
        self.send(url, req)
            .await?
            .bytes()
            .await
            .map_err(|source| ClientError::Http {
                url: url.to_owned(),
                source,
            })
    }

    pub(crate) async fn json<T: DeserializeOwned>(
        &self,
        url: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<T, ClientError> {
        self.send(url, req)
            .await?
            .json()
            .await
            .map_err(|source| ClientError::Http {
                url: url.to_owned(),
                source,
            })
    }

    pub(crate) async fn get_json<T: DeserializeOwned>(&self, url: &str) -> Result<T, ClientError> {
        self.json(url, self.http.get(url)).await
    }

    /// Posts a codec document, answered with JSON.
    pub(crate) async fn post_document<T: DeserializeOwned>(
        &self,
        url: &str,
        body: Vec<u8>,
    ) -> Result<T, ClientError> {
        self.json(
            url,
            self.http
                .post(url)
                .header(
                    reqwest::header::CONTENT_TYPE,
                    kt_types::codec::DOCUMENT_CONTENT_TYPE,
                )
                .body(body),
        )
        .await
    }

    /// The store's URL, as registered with the metadata server.
    pub async fn store_url(&self) -> Result<String, ClientError> {
        let loc: StoreLocation = self.get_json(&self.meta("store")).await?;
        let url = self.map_url(loc.url.trim_end_matches('/'))?;
        Ok(url.trim_end_matches('/').to_owned())
    }

    pub async fn stat(&self, key: &Key) -> Result<KeyRecord, ClientError> {
        self.get_json(&self.meta(&format!("keys/{key}"))).await
    }

    pub async fn ls(&self, prefix: &KeyPrefix) -> Result<ListResponse, ClientError> {
        let url = self.meta("keys");
        self.json(
            &url,
            self.http.get(&url).query(&[("prefix", prefix.as_str())]),
        )
        .await
    }

    /// Deletes a service's `resource` keys and evicts its pods as sources.
    pub async fn teardown(&self, service: &str) -> Result<TeardownResponse, ClientError> {
        let url = self.meta(&format!("services/{service}"));
        self.json(&url, self.http.delete(&url)).await
    }

    pub async fn rm(&self, key: &Key, recursive: bool) -> Result<DeleteResponse, ClientError> {
        let url = self.meta(&format!("keys/{key}"));
        self.json(
            &url,
            self.http
                .delete(&url)
                .query(&[("recursive", if recursive { "true" } else { "false" })]),
        )
        .await
    }
}
