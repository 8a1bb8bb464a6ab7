//! The HTTP client: metadata calls and the store's sync protocol endpoints.

use std::path::PathBuf;
use std::time::Duration;

use kt_api::Api;
use kt_types::api::{DeleteResponse, ListResponse, StoreLocation, TeardownResponse};
use kt_types::{ErrorCode, Key, KeyPrefix, KeyRecord, paths};

use crate::error::ClientError;

/// How a client reaches kt and moves data.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub metadata_url: String,
    pub token: String,
    /// The file `token` was read from, read again as it is rotated (a
    /// projected ServiceAccount token, which the kubelet renews hourly):
    /// a long-lived client keeps presenting a valid token.
    pub token_file: Option<PathBuf>,
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
    /// Whether a node agent is started when none runs (a local put, a
    /// served copy); off (`KT_AGENT_AUTOSTART=0`), the pod's own agent is
    /// waited for instead ([`crate::agent::autostart`]).
    pub agent_autostart: bool,
    /// The HTTP client's limit on any one request (long polls, a whole
    /// chunk); the waits below end calls long before.
    pub timeout: Duration,
    /// How long a call may go on failing to reach the metadata server
    /// before it has answered once (refused, no route, DNS, no answer),
    /// counted from the call's start; also the limit of one TCP connect
    /// (`--connect-timeout`, `KT_CONNECT_TIMEOUT`). See [`crate::deadline`].
    pub connect_timeout: Duration,
    /// How long a transfer keeps trying while its sources fail transiently
    /// (a store restarting, a peer unreachable), counted from its last
    /// progress (`--deadline`, `KT_DEADLINE`). A transfer that moves is
    /// never cut by it.
    pub deadline: Duration,
    /// A limit on each whole call (put, get, ls, rm, stat), whatever it is
    /// doing; `None`: none beyond the waits above. Set for one call with
    /// [`Client::with_timeout`] (Python's `timeout=`).
    pub call_timeout: Option<Duration>,
    /// How long a data request may go without receiving a byte before its
    /// source counts as stalled (`--stall-timeout`, `KT_STALL_TIMEOUT`).
    pub stall: Duration,
}

/// Default of [`ClientConfig::connect_timeout`]: a stopped metadata server
/// fails a call within about twice this (a connect already under way when it
/// runs out is let finish), well within 10 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(4);
/// Default of [`ClientConfig::deadline`].
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(300);
/// Default of [`ClientConfig::stall`].
pub const DEFAULT_STALL: Duration = Duration::from_secs(20);

impl ClientConfig {
    pub fn new(metadata_url: impl Into<String>, token: impl Into<String>) -> Self {
        ClientConfig {
            metadata_url: metadata_url.into().trim_end_matches('/').to_owned(),
            token: token.into(),
            token_file: None,
            streams: kt_sync::defaults::STREAMS,
            cache_dir: default_cache_dir(),
            agent_socket: crate::agent::default_socket(),
            serve_copies: true,
            agent_autostart: crate::agent::autostart(),
            timeout: Duration::from_secs(3600),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            deadline: DEFAULT_DEADLINE,
            call_timeout: None,
            stall: DEFAULT_STALL,
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
    /// The metadata server; [`Api::at`] reaches the store and sources with
    /// the same connection pool and token.
    pub(crate) meta: Api,
    pub(crate) cfg: ClientConfig,
    url_map: Option<std::sync::Arc<dyn UrlMap>>,
}

impl Client {
    /// This client with every call it makes carrying `trace` (the
    /// `traceparent` header; [`crate::trace::operation`]), whatever task
    /// makes it.
    pub fn traced(&self, trace: kt_api::trace::TraceParent) -> Client {
        Client {
            meta: self.meta.traced(Some(trace)),
            ..self.clone()
        }
    }

    /// The trace its calls carry, if any.
    pub fn trace(&self) -> Option<kt_api::trace::TraceParent> {
        self.meta.trace()
    }

    pub fn new(cfg: ClientConfig) -> Result<Self, ClientError> {
        let http = kt_api::tls::http_builder()
            .map_err(|e| ClientError::Local(e.to_string()))?
            .timeout(cfg.timeout)
            .connect_timeout(cfg.connect_timeout.max(Duration::from_millis(100)))
            .pool_max_idle_per_host(cfg.streams.max(1) * 2)
            .build()
            .map_err(|e| ClientError::Local(format!("http client: {e}")))?;
        let token = kt_api::Credential::file_or(cfg.token_file.as_deref(), &cfg.token);
        Ok(Client {
            meta: Api::new(http, &cfg.metadata_url, token),
            cfg,
            url_map: None,
        })
    }

    /// Where a put of `src` keeps its scan cache ([`kt_sync::ScanCache`]);
    /// `None` without a cache directory. A writer that hashed the files it
    /// wrote may seed it, so the put does not read them again.
    pub fn scan_cache_path(&self, src: &std::path::Path) -> Option<PathBuf> {
        crate::local::cache_file(self, src)
    }

    /// The token to present now (read again from its file as it rotates).
    pub fn bearer(&self) -> std::sync::Arc<str> {
        self.meta.credential().value()
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

    /// This client with [`ClientConfig::call_timeout`] set to `limit` (the
    /// same connection pool): a per-call `timeout` that overrides the
    /// configured one, e.g. `client.with_timeout(Some(d)).get(..)`.
    pub fn with_timeout(&self, limit: Option<Duration>) -> Client {
        let mut c = self.clone();
        c.cfg.call_timeout = limit;
        c
    }

    /// `call` tracked as one call (`what`: "ls of a/"): its phase named and
    /// its whole run bounded by [`ClientConfig::call_timeout`].
    pub(crate) async fn call<T>(
        &self,
        what: impl FnOnce() -> String,
        call: impl std::future::Future<Output = Result<T, ClientError>>,
    ) -> Result<T, ClientError> {
        // Boxed: a call's future is large, and wrapping it must not make
        // the caller's (a whole test, a Python call) larger still.
        crate::deadline::track(self.cfg.call_timeout, what, Box::pin(call)).await
    }

    /// A metadata request `call` makes, tried until the metadata server
    /// first answers within [`ClientConfig::connect_timeout`] (see
    /// [`crate::deadline`]).
    pub(crate) async fn first_contact<T, F, Fut>(&self, call: F) -> Result<T, ClientError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        crate::deadline::first_contact(&self.cfg.metadata_url, self.cfg.connect_timeout, call).await
    }

    /// A call that is one metadata request: [`Client::call`]'s bounds
    /// around [`Client::first_contact`]'s.
    pub(crate) async fn ask<T, F, Fut>(
        &self,
        what: impl FnOnce() -> String,
        request: F,
    ) -> Result<T, ClientError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        self.call(what, self.first_contact(request)).await
    }

    /// A call that is one metadata request: what `request` asks of the
    /// metadata server's [`Api`] (asked again on each try), answered
    /// within `timeout`, decoded.
    pub(crate) async fn ask_meta<T: serde::de::DeserializeOwned>(
        &self,
        what: impl FnOnce() -> String,
        timeout: Duration,
        request: impl Fn(&Api) -> kt_api::Call,
    ) -> Result<T, ClientError> {
        let request = &request;
        self.ask(what, || async move {
            Ok(request(&self.meta).timeout(timeout).fetch().await?)
        })
        .await
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

    /// A server the metadata server named (the store, a source), through
    /// the [`UrlMap`].
    pub(crate) fn server(&self, url: &str) -> Result<Api, ClientError> {
        Ok(self.meta.at(&self.map_url(url)?))
    }

    /// [`Client::server`], presenting `key` there instead of this client's
    /// token when there is one (a broadcast parent's relay key).
    pub(crate) fn server_keyed(&self, url: &str, key: Option<&str>) -> Result<Api, ClientError> {
        match key {
            Some(k) => Ok(self.meta.at_with(&self.map_url(url)?, k)),
            None => self.server(url),
        }
    }

    /// The store's URL, as registered with the metadata server.
    pub async fn store_url(&self) -> Result<String, ClientError> {
        let loc: StoreLocation = self
            .meta
            .get(&paths::store())
            .timeout(self.cfg.stall)
            .fetch()
            .await?;
        let url = self.map_url(loc.url.trim_end_matches('/'))?;
        Ok(url.trim_end_matches('/').to_owned())
    }

    pub async fn stat(&self, key: &Key) -> Result<KeyRecord, ClientError> {
        self.ask_meta(
            || format!("stat of {key}"),
            self.cfg.stall,
            |m| m.get(&paths::key(key)),
        )
        .await
    }

    pub async fn ls(&self, prefix: &KeyPrefix) -> Result<ListResponse, ClientError> {
        self.list(prefix, false).await
    }

    /// Every key strictly below `prefix`, at any depth (each entry named by
    /// its path below the prefix).
    pub async fn ls_below(&self, prefix: &KeyPrefix) -> Result<ListResponse, ClientError> {
        self.list(prefix, true).await
    }

    async fn list(&self, prefix: &KeyPrefix, recursive: bool) -> Result<ListResponse, ClientError> {
        let mut query = vec![("prefix", prefix.as_str())];
        if recursive {
            query.push(("recursive", "true"));
        }
        self.ask_meta(
            || format!("ls of {prefix}"),
            self.cfg.stall,
            |m| m.get(&paths::keys()).query(&query),
        )
        .await
    }

    /// Tears a service down: deletes what its lifespan covers (its base path
    /// but explicit `cluster` keys, its `resource` keys, its pods'
    /// zero-copy keys) and evicts its pods as sources.
    pub async fn teardown(&self, service: &str) -> Result<TeardownResponse, ClientError> {
        // Work in proportion to the service's keys: answered within the
        // deadline, not the stall timeout.
        self.ask_meta(
            || format!("teardown of {service}"),
            self.cfg.deadline,
            |m| m.delete(&paths::service(service)),
        )
        .await
    }

    pub async fn rm(&self, key: &Key, recursive: bool) -> Result<DeleteResponse, ClientError> {
        let recursive = if recursive { "true" } else { "false" };
        self.ask_meta(
            || format!("rm of {key}"),
            self.cfg.deadline,
            |m| {
                m.delete(&paths::key(key))
                    .query(&[("recursive", recursive)])
            },
        )
        .await
    }
}
