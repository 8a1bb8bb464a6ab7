//! HTTPS for kt's servers (`--tls-cert`, `--tls-key`; `KT_TLS_CERT`,
//! `KT_TLS_KEY`): rustls with ring. The certificate and key are read
//! again when their files change (cert-manager renews them in place), at
//! most every [`RECHECK`], on a handshake; a renewal that cannot be read
//! keeps the last good pair. Handshakes run beside the accept loop, each
//! bounded by [`HANDSHAKE`], so a client that never finishes one holds up
//! nobody.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// How often the files are looked at for a renewal.
pub const RECHECK: Duration = Duration::from_secs(30);
/// The longest a client may take over its handshake.
pub const HANDSHAKE: Duration = Duration::from_secs(10);

/// Why the certificate or key cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("--tls-cert and --tls-key go together (KT_TLS_CERT, KT_TLS_KEY)")]
    Half,
    #[error("{path}: {why}")]
    File { path: String, why: String },
    #[error("certificate {cert} and key {key}: {why}")]
    Pair {
        cert: String,
        key: String,
        why: String,
    },
}

/// A server's TLS configuration (cheap to clone).
#[derive(Clone)]
pub struct Tls {
    config: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls")
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let file = |p: &Path, why: String| TlsError::File {
        path: p.display().to_string(),
        why,
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| file(cert, e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file(cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(file(cert, "no PEM certificate in it".into()));
    }
    let der = PrivateKeyDer::from_pem_file(key).map_err(|e| file(key, e.to_string()))?;
    CertifiedKey::from_der(chain, der, &provider()).map_err(|e| TlsError::Pair {
        cert: cert.display().to_string(),
        key: key.display().to_string(),
        why: e.to_string(),
    })
}

fn stamp(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// The certificate, read again when its files change.
#[derive(Debug)]
struct Reloading {
    cert: PathBuf,
    key: PathBuf,
    every: Duration,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    current: Arc<CertifiedKey>,
    checked: Instant,
    stamps: (Option<SystemTime>, Option<SystemTime>),
}

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.checked.elapsed() >= self.every {
            st.checked = Instant::now();
            let stamps = (stamp(&self.cert), stamp(&self.key));
            if stamps != st.stamps {
                match load(&self.cert, &self.key) {
                    Ok(k) => {
                        st.current = Arc::new(k);
                        st.stamps = stamps;
                        tracing::info!(cert = %self.cert.display(), "TLS certificate reloaded");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "TLS certificate changed but cannot be used; keeping the last one");
                    }
                }
            }
        }
        Some(st.current.clone())
    }
}

impl Tls {
    /// The pair in `cert` (PEM chain) and `key` (PEM key), checked now.
    pub fn load(cert: &Path, key: &Path) -> Result<Tls, TlsError> {
        Tls::reloading(cert, key, RECHECK)
    }

    /// [`Tls::load`], looking for a renewal at most every `every`.
    pub fn reloading(cert: &Path, key: &Path, every: Duration) -> Result<Tls, TlsError> {
        let first = load(cert, key)?;
        let resolver = Reloading {
            cert: cert.to_owned(),
            key: key.to_owned(),
            every,
            state: Mutex::new(State {
                current: Arc::new(first),
                checked: Instant::now(),
                stamps: (stamp(cert), stamp(key)),
            }),
        };
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::File {
                path: cert.display().to_string(),
                why: e.to_string(),
            })?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(resolver));
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Tls {
            config: Arc::new(config),
        })
    }

    /// The same certificate (reloaded alike) offering ALPN `h2` only: for
    /// gRPC, whose clients refuse a server that offers `http/1.1` alone.
    pub fn h2(&self) -> Tls {
        let mut config = (*self.config).clone();
        config.alpn_protocols = vec![b"h2".to_vec()];
        Tls {
            config: Arc::new(config),
        }
    }

    /// `--tls-cert` and `--tls-key`: both or neither.
    pub fn from_args(cert: Option<&Path>, key: Option<&Path>) -> Result<Option<Tls>, TlsError> {
        match (cert, key) {
            (Some(c), Some(k)) => Tls::load(c, k).map(Some),
            (None, None) => Ok(None),
            _ => Err(TlsError::Half),
        }
    }

    /// The env pair `KT_TLS_CERT`/`KT_TLS_KEY` (a broadcast relay in a
    /// workload's process serves with its pod's certificate).
    pub fn from_env() -> Result<Option<Tls>, TlsError> {
        let var = |n| {
            std::env::var_os(n)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let (c, k) = (var(kt_types::env::TLS_CERT), var(kt_types::env::TLS_KEY));
        Tls::from_args(c.as_deref(), k.as_deref())
    }
}

/// Accepted TLS connections, handshaken beside the accept loop (an
/// `axum::serve` listener).
#[derive(Debug)]
pub struct TlsListener {
    ready: mpsc::Receiver<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)>,
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    /// Serves `tls` on `tcp`.
    pub fn new(tcp: TcpListener, tls: &Tls) -> std::io::Result<TlsListener> {
        TlsListener::with_config(tcp, tls.config.clone())
    }

    /// Serves a rustls configuration made elsewhere (the test API server's
    /// own CA) on `tcp`.
    pub fn with_config(
        tcp: TcpListener,
        config: Arc<rustls::ServerConfig>,
    ) -> std::io::Result<TlsListener> {
        let addr = tcp.local_addr()?;
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let (tx, ready) = mpsc::channel(64);
        let task = tokio::spawn(async move {
            loop {
                let (stream, peer) = match tcp.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors and the like: try again shortly.
                        tracing::debug!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE, acceptor.accept(stream)).await {
                        Ok(Ok(s)) => {
                            let _ = tx.send((s, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { ready, addr, task })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accept loop ended (it never does on its own).
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.addr)
    }
}
