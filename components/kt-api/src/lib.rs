//! The HTTP client of kt's servers, the one every component that calls
//! another goes through (the CLI library, the node agent, the store's
//! registrar, the metadata server's calls to the store, the scenario
//! runner, the tests):
//!
//! - [`Api`] is a server (its base URL), the bearer token and a shared
//!   `reqwest::Client`; paths come from [`kt_types::paths`], so values are
//!   percent-encoded in one place.
//! - [`check`] is the one decoder of answers: success, or a
//!   [`CallError::Status`] with the server's `ErrorBody` code and message
//!   (a body that is not one gets its code from the status,
//!   [`ErrorCode::from_status`]).
//! - [`Call::retry`] retries what may be retried: a request that never
//!   reached the server (the connection failed), and an idempotent one
//!   answered `unavailable` by a proxy or a server shutting down (502, 503,
//!   504 with code `unavailable`), waiting with [`Backoff`] (exponential,
//!   with jitter, so a thousand clients that failed together do not come
//!   back together). Nothing is retried unless the caller asks: a getter
//!   failing over to another source wants to know at once.
//!
//! - [`Credential`] is the bearer token: fixed, or a file read again as
//!   the kubelet rotates it (projected ServiceAccount tokens).
//!
//! - [`client_builder`] is where every `reqwest` client starts (no proxy,
//!   [`CONNECT_TIMEOUT`]); [`client`] builds one as it is.
//!
//! - [`tls`]: https, trusting the CAs of `KT_CA_FILE` only.
//!
//! - [`trace`]: the W3C `traceparent` every request carries (the
//!   [`Api`]'s own trace, else the running task's).
//!
//! Invariant: no server code; depends on kt-types, reqwest and rustls only.

mod builder;
mod credential;
pub mod tls;
pub mod trace;

pub use builder::{CONNECT_TIMEOUT, POOL_IDLE, client, client_builder};
pub use credential::Credential;

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use kt_types::{ErrorBody, ErrorCode};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// What a call to a kt server ended with, when not success.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The server was not reached, or the exchange broke off (refused,
    /// reset, timed out).
    #[error("{url}: {source}")]
    Transport {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// The server answered with an error.
    #[error("{message} ({code}, HTTP {status})")]
    Status {
        url: String,
        status: u16,
        code: ErrorCode,
        message: String,
    },
    /// The answer's body could not be read or decoded.
    #[error("{url}: unreadable answer: {source}")]
    Decode {
        url: String,
        #[source]
        source: reqwest::Error,
    },
}

impl CallError {
    /// The error's code: the server's, or `unavailable` for a server that
    /// was not reached and `internal` for an answer that made no sense.
    pub fn code(&self) -> ErrorCode {
        match self {
            CallError::Transport { .. } => ErrorCode::Unavailable,
            CallError::Status { code, .. } => *code,
            CallError::Decode { .. } => ErrorCode::Internal,
        }
    }

    /// The URL that was called.
    pub fn url(&self) -> &str {
        match self {
            CallError::Transport { url, .. }
            | CallError::Status { url, .. }
            | CallError::Decode { url, .. } => url,
        }
    }

    /// Nothing reached the server: sending it again is safe whatever the
    /// method.
    pub fn not_sent(&self) -> bool {
        matches!(self, CallError::Transport { source, .. } if source.is_connect())
    }

    /// The server (or a proxy before it) is away for now: 502, 503 or 504
    /// with code `unavailable`. Not `no_source` or `no_store`, which are
    /// answers about the data, nor a connection that broke mid-way.
    pub fn server_away(&self) -> bool {
        matches!(
            self,
            CallError::Status {
                status: 502..=504,
                code: ErrorCode::Unavailable,
                ..
            }
        )
    }
}

/// Turns an answer into an error unless it succeeded.
pub async fn check(url: &str, resp: reqwest::Response) -> Result<reqwest::Response, CallError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let text = resp.text().await.unwrap_or_default();
    let status = status.as_u16();
    Err(match serde_json::from_str::<ErrorBody>(&text) {
        Ok(b) => CallError::Status {
            url: url.to_owned(),
            status,
            code: b.error.code,
            message: b.error.message,
        },
        Err(_) => CallError::Status {
            url: url.to_owned(),
            status,
            code: ErrorCode::from_status(status),
            message: format!("{url}: {}", text.trim()),
        },
    })
}

/// A kt server: its base URL, the bearer token, and the HTTP client (one
/// connection pool, shared by clones).
#[derive(Clone)]
pub struct Api {
    http: reqwest::Client,
    base: String,
    token: Credential,
    /// The trace its calls carry; `None`: the running task's
    /// ([`trace::current`]).
    trace: Option<trace::TraceParent>,
}

impl fmt::Debug for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Api")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl Api {
    /// `base` is the server's URL (`http://kt-metadata:8081`; a trailing
    /// slash is dropped).
    pub fn new(http: reqwest::Client, base: &str, token: impl Into<Credential>) -> Api {
        Api {
            http,
            base: base.trim_end_matches('/').to_owned(),
            token: token.into(),
            trace: None,
        }
    }

    /// The same client and token for another server (and the same trace).
    pub fn at(&self, base: &str) -> Api {
        self.at_with(base, &self.token)
    }

    /// The same client for another server, presenting `token` there.
    pub fn at_with(&self, base: &str, token: impl Into<Credential>) -> Api {
        Api {
            trace: self.trace,
            ..Api::new(self.http.clone(), base, token)
        }
    }

    /// The same, its calls (and those of the `Api`s made from it with
    /// [`Api::at`]) carrying `trace` whatever task makes them.
    pub fn traced(&self, trace: Option<trace::TraceParent>) -> Api {
        Api {
            trace,
            ..self.clone()
        }
    }

    /// The trace its calls carry now.
    pub fn trace(&self) -> Option<trace::TraceParent> {
        self.trace.or_else(trace::current)
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// The token it presents.
    pub fn credential(&self) -> &Credential {
        &self.token
    }

    /// The URL of `path` (from [`kt_types::paths`]) on this server.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    pub fn get(&self, path: &str) -> Call {
        self.request(reqwest::Method::GET, path)
    }

    pub fn put(&self, path: &str) -> Call {
        self.request(reqwest::Method::PUT, path)
    }

    pub fn post(&self, path: &str) -> Call {
        self.request(reqwest::Method::POST, path)
    }

    pub fn delete(&self, path: &str) -> Call {
        self.request(reqwest::Method::DELETE, path)
    }

    pub fn request(&self, method: reqwest::Method, path: &str) -> Call {
        let url = self.url(path);
        let idempotent = matches!(
            method,
            reqwest::Method::GET
                | reqwest::Method::HEAD
                | reqwest::Method::PUT
                | reqwest::Method::DELETE
        );
        let mut req = self
            .http
            .request(method, &url)
            .bearer_auth(&*self.token.value());
        if let Some(t) = self.trace() {
            req = req.header(trace::HEADER, t.to_string());
        }
        Call {
            req,
            url,
            idempotent,
            retries: 0,
            backoff: Backoff::new(Duration::from_millis(50), Duration::from_secs(2)),
        }
    }
}

/// One request to a kt server, built up and then sent.
#[derive(Debug)]
pub struct Call {
    url: String,
    req: reqwest::RequestBuilder,
    idempotent: bool,
    retries: u32,
    backoff: Backoff,
}

impl Call {
    /// A JSON body.
    pub fn json<B: Serialize + ?Sized>(mut self, body: &B) -> Call {
        self.req = self.req.json(body);
        self
    }

    /// A raw body (a codec document, a frame stream, chunk bytes). A
    /// streamed body is sent once: it cannot be retried.
    pub fn body(mut self, body: impl Into<reqwest::Body>) -> Call {
        self.req = self.req.body(body);
        self
    }

    pub fn header(mut self, name: reqwest::header::HeaderName, value: &str) -> Call {
        self.req = self.req.header(name, value);
        self
    }

    /// Query parameters (encoded by reqwest).
    pub fn query<Q: Serialize + ?Sized>(mut self, q: &Q) -> Call {
        self.req = self.req.query(q);
        self
    }

    /// This request's time limit instead of the client's (long polls).
    pub fn timeout(mut self, t: Duration) -> Call {
        self.req = self.req.timeout(t);
        self
    }

    /// Sends it up to `retries` more times while it fails in a way that
    /// may be retried ([`CallError::not_sent`]; for idempotent methods also
    /// [`CallError::server_away`]), waiting with backoff and jitter.
    pub fn retry(mut self, retries: u32) -> Call {
        self.retries = retries;
        self
    }

    /// The same with a backoff of its own.
    pub fn retry_with(mut self, retries: u32, backoff: Backoff) -> Call {
        self.retries = retries;
        self.backoff = backoff;
        self
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Sends it: the successful response, or the error.
    pub async fn send(mut self) -> Result<reqwest::Response, CallError> {
        loop {
            let again = (self.retries > 0).then(|| self.req.try_clone()).flatten();
            let result = match self.req.send().await {
                Ok(resp) => check(&self.url, resp).await,
                Err(source) => Err(CallError::Transport {
                    url: self.url.clone(),
                    source,
                }),
            };
            let retryable = |e: &CallError| e.not_sent() || (self.idempotent && e.server_away());
            match (result, again) {
                (Err(e), Some(next)) if retryable(&e) => {
                    self.retries -= 1;
                    self.req = next;
                    tokio::time::sleep(self.backoff.next_delay()).await;
                }
                (result, _) => return result,
            }
        }
    }

    /// Sends it and decodes a JSON answer.
    pub async fn fetch<T: DeserializeOwned>(self) -> Result<T, CallError> {
        let url = self.url.clone();
        self.send()
            .await?
            .json()
            .await
            .map_err(|source| CallError::Decode { url, source })
    }

    /// Sends it and reads the whole answer.
    pub async fn bytes(self) -> Result<bytes::Bytes, CallError> {
        let url = self.url.clone();
        self.send()
            .await?
            .bytes()
            .await
            .map_err(|source| CallError::Transport { url, source })
    }

    /// Sends it; the answer's body is not needed.
    pub async fn ok(self) -> Result<(), CallError> {
        self.send().await.map(drop)
    }
}

/// Exponential backoff with jitter: attempt n waits between half and all
/// of `min(max, base * 2^n)`, chosen at random, so clients that failed
/// together spread out when they come back.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(base: Duration, max: Duration) -> Backoff {
        Backoff {
            base,
            max: max.max(base),
            attempt: 0,
        }
    }

    /// The wait before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        let half = d / 2;
        let nanos = half.as_nanos().min(u64::MAX as u128) as u64;
        half + Duration::from_nanos(if nanos == 0 {
            0
        } else {
            random_u64() % (nanos + 1)
        })
    }

    /// The longest the next wait may be.
    pub fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// Sleeps for [`Backoff::next_delay`].
    pub async fn wait(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }

    /// Back to the first attempt (after a success).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// A random number for jitter, without a dependency: the standard library
/// seeds each `RandomState` from its own randomness.
fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.finish()
}

#[cfg(test)]
mod tests;
