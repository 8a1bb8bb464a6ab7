//! Where every `reqwest` client of the workspace starts (outside kt-api, no
//! code calls `reqwest::Client::builder()`, `ClientBuilder::new()` or
//! `Client::new()`: tidy checks it), so the project's defaults are set once.

use std::time::Duration;

/// How long a client waits for a TCP (and TLS) connection before the call
/// fails: the same 4 s as the CLI's first contact
/// (`kt_client::DEFAULT_CONNECT_TIMEOUT`). A peer that is down refuses at
/// once; one that is unreachable (a cut link, a stopped host) would
/// otherwise hold the call for the OS's SYN retries (minutes).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(4);

/// How long a pooled connection may sit idle before the client closes it:
/// shorter than a kt server's wait for the next request on a kept-alive
/// connection (`kt_service::conn::HEAD_TIMEOUT`, 60 s), so the client
/// ends an idle connection before the server does and no request is sent
/// on a connection the server is closing.
pub const POOL_IDLE: Duration = Duration::from_secs(30);

/// A `reqwest` client builder with the project's defaults: no proxy (kt's
/// servers are reached directly, on the cluster's or the testbed's own
/// network; an inherited `HTTP_PROXY` would send loopback and pod traffic
/// astray) [`CONNECT_TIMEOUT`] and [`POOL_IDLE`]. No overall timeout: a transfer may take
/// long; callers that want one set `.timeout(..)`. For https with
/// `KT_CA_FILE`'s CAs, start from [`crate::tls::http_builder`] instead.
pub fn client_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(CONNECT_TIMEOUT)
        .pool_idle_timeout(POOL_IDLE)
}

/// A client built from [`client_builder`] with nothing added. Panics, as
/// `reqwest::Client::new` does, only if the TLS backend cannot start.
pub fn client() -> reqwest::Client {
    client_builder()
        .build()
        .expect("an HTTP client with the default settings builds")
}
