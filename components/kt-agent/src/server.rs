//! Wiring: the read API over HTTP, the control socket, the heartbeat.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::DefaultBodyLimit;
use kt_service::reads::Reads;
use kt_service::{Metrics, Ready};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, advertised};
use crate::control::{self, Agent, SocketError};
use crate::datasets::NodeCache;
use crate::exports::{ExportError, Exports};
use crate::heartbeat::{BeatStats, Identity, heartbeat_loop};
use crate::metadata::MetadataClient;
use crate::tensors::{TensorConfig, Tensors, reap_loop};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("state: {0}")]
    State(#[from] ExportError),
    #[error("{0}")]
    Socket(#[from] SocketError),
    #[error("serving: {0}")]
    Serve(#[from] std::io::Error),
    #[error("configuration: {0}")]
    Config(String),
    #[error("node cache: {0}")]
    NodeCache(#[from] crate::datasets::NodeCacheError),
}

/// A running agent.
#[derive(Debug)]
pub struct AgentHandle {
    pub id: String,
    /// The URL peers fetch from (announced in heartbeats and records).
    pub url: String,
    pub socket: PathBuf,
    pub metrics: Arc<Metrics>,
    pub exports: Arc<Exports>,
    pub heartbeats: Arc<BeatStats>,
    pub tensors: Arc<Tensors>,
    /// The node's datasets, in node-cache mode.
    pub datasets: Option<Arc<NodeCache>>,
    /// Where Arrow Flight is served (`--flight-addr`), if it is.
    pub flight_addr: Option<std::net::SocketAddr>,
    pub task: JoinHandle<Result<(), AgentError>>,
}

/// Loads the exports, binds the control socket, and starts serving on
/// `listener` in a task that ends after `shutdown` is cancelled (the socket
/// file is removed then).
pub fn start(
    listener: TcpListener,
    cfg: Config,
    shutdown: CancellationToken,
) -> Result<AgentHandle, AgentError> {
    kt_sync::chunk::check_chunk_size(cfg.chunk_size)
        .map_err(|e| AgentError::Config(e.to_string()))?;
    check_id(&cfg.id)?;
    if let Some(service) = &cfg.service {
        kt_types::Key::parse(service)
            .map_err(|e| AgentError::Config(format!("service name: {e}")))?;
    }
    if let Some(u) = cfg
        .advertise_url
        .as_deref()
        .filter(|u| !(u.starts_with("http://") || u.starts_with("https://")))
    {
        return Err(AgentError::Config(format!(
            "advertise URL {u:?} is not an http(s) URL"
        )));
    }
    let url = advertised(
        listener.local_addr()?,
        cfg.advertise_url.as_deref(),
        cfg.pod_ip.as_deref(),
        cfg.server.tls.is_some(),
    );
    // The socket's directory, then the state directory, are made this
    // agent's alone before anything is written in either.
    let (control_listener, socket_file) = control::bind(&cfg.socket, cfg.socket_group)?;
    control::private_dir(&cfg.state_dir, kt_service::cli::uid())?;
    let exports = Arc::new(Exports::open(&cfg.state_dir, cfg.chunk_size, &cfg.limits)?);
    let metadata = Arc::new(
        MetadataClient::new(
            &cfg.metadata_url,
            cfg.server.token.clone(),
            cfg.metadata_timeout,
        )
        .map_err(AgentError::Config)?,
    );
    let datasets = match &cfg.node_cache {
        Some(nc) => Some(node_cache(&cfg, nc, exports.clone())?),
        None => None,
    };
    // A node-cache agent serves its fetched versions and nothing else
    // (unless export roots are given).
    let export_roots = match &cfg.node_cache {
        Some(nc) if cfg.export_roots.is_empty() => vec![nc.versions_dir()],
        _ => cfg.export_roots.clone(),
    };
    // Its state, never served (the socket's directory may be the pod's
    // home, where the workload's data is: the socket itself is no file).
    let exportable = crate::exportable::Exportable::new(&export_roots, &[&cfg.state_dir]);
    let metrics = Arc::new(Metrics::new());
    let reads = Reads::new(
        exports.clone(),
        metadata.clone(),
        metrics.clone(),
        cfg.lease_ttl,
    );
    let heartbeats = Arc::new(BeatStats::default());
    let tensors = Arc::new(
        Tensors::new(
            cfg.id.clone(),
            url.clone(),
            tensor_ip(&url, cfg.pod_ip.as_deref()),
            metadata.clone(),
            TensorConfig {
                shm_dir: cfg.shm_dir.clone(),
                ports: cfg.tensor_ports.clone(),
                state_dir: cfg.state_dir.clone(),
                timeout: cfg.tensor_timeout,
                node: cfg.node.clone(),
            },
        )
        .map_err(AgentError::Config)?,
    );
    metrics.attach(Arc::new(crate::metrics::AgentGauges {
        exports: Arc::downgrade(&exports),
        reads: Arc::downgrade(&reads),
        tensors: Arc::downgrade(&tensors),
        heartbeats: Arc::downgrade(&heartbeats),
    }));
    let agent = Arc::new(Agent {
        id: cfg.id.clone(),
        url: url.clone(),
        exports: exports.clone(),
        metadata: metadata.clone(),
        limits: cfg.limits,
        local_puts: Default::default(),
        exportable,
        tensors: tensors.clone(),
        shm_dir: cfg
            .shm_dir
            .canonicalize()
            .unwrap_or_else(|_| cfg.shm_dir.clone()),
        clients: Default::default(),
    });
    tracing::info!(
        id = %cfg.id,
        %url,
        socket = %cfg.socket.display(),
        state_dir = %cfg.state_dir.display(),
        exports = exports.len(),
        "agent starting"
    );
    let (flight_addr, flight) = match flight(&cfg, shutdown.clone())? {
        Some((addr, task)) => (Some(addr), Some(task)),
        None => (None, None),
    };
    let ready = Ready::default();
    // Getters show capabilities the metadata server signed, never their
    // tokens; the keys to check them come with every heartbeat reply.
    let capabilities = Arc::new(kt_service::capability::Verifier::new(cfg.id.clone()));
    let mut routes = reads.routes().merge(crate::tensors::routes(
        tensors.clone(),
        capabilities.clone(),
    ));
    if let Some(d) = &datasets {
        routes = routes.merge(d.routes());
    }
    let app = kt_service::app(
        routes.layer(DefaultBodyLimit::max(cfg.max_request_bytes)),
        cfg.server.callers().with_capabilities(capabilities.clone()),
        metrics.clone(),
        ready.clone(),
        cfg.server.max_in_flight,
    );
    let app = kt_service::trace::layer(app, "agent");
    let who = Identity {
        id: cfg.id.clone(),
        url: url.clone(),
        service: cfg.service.clone(),
    };
    let beat = tokio::spawn(heartbeat_loop(
        metadata,
        (who, capabilities),
        exports.clone(),
        tensors.clone(),
        heartbeats.clone(),
        cfg.heartbeat,
        shutdown.clone(),
    ));
    let idle = cfg.exit_when_idle.map(|grace| {
        tokio::spawn(control::exit_when_idle(
            agent.clone(),
            grace,
            shutdown.clone(),
        ))
    });
    let control = tokio::spawn(control::serve(control_listener, agent, shutdown.clone()));
    let sweeper = tokio::spawn(sweep(reads.clone(), shutdown.clone()));
    let reaper = tokio::spawn(reap_loop(tensors.clone(), shutdown.clone()));
    ready.set(true);
    let (drain, tls) = (cfg.drain, cfg.server.tls.clone());
    let stop = shutdown.clone();
    let seeds = datasets.clone();
    let task = tokio::spawn(async move {
        let served = kt_service::serve_tls(listener, app, stop.clone(), drain, tls.as_ref()).await;
        stop.cancel();
        if let Some(d) = seeds {
            d.stop().await;
        }
        let _ = tokio::join!(beat, control, sweeper, reaper);
        // Flight streams in progress get the drain time, as HTTP's do.
        if let Some(mut flight) = flight
            && tokio::time::timeout(drain, &mut flight).await.is_err()
        {
            flight.abort();
        }
        if let Some(idle) = idle {
            let _ = idle.await;
        }
        reads.release_all().await;
        drop(socket_file);
        tracing::info!("agent stopped");
        served.map_err(AgentError::from)
    });
    Ok(AgentHandle {
        id: cfg.id,
        url,
        socket: cfg.socket,
        metrics,
        exports,
        heartbeats,
        tensors,
        datasets,
        flight_addr,
        task,
    })
}

/// A bound Flight server and the task serving it until shutdown.
type FlightServer = Option<(std::net::SocketAddr, JoinHandle<()>)>;

/// The Arrow Flight server (`--flight-addr`), bound now and served until
/// `shutdown`; reads go below `--flight-dir` (required in a pod).
#[cfg(feature = "flight")]
fn flight(cfg: &Config, shutdown: CancellationToken) -> Result<FlightServer, AgentError> {
    let Some(f) = &cfg.flight else {
        return Ok(None);
    };
    // With --tls-cert, Flight is TLS too: callers' bearer tokens never
    // cross the network in the clear where the agent has a certificate.
    let listener = crate::flight::bind(f.addr, cfg.server.tls.as_ref())?;
    let addr = listener.local_addr()?;
    let scratch = crate::flight::scratch_dir(f, &cfg.state_dir, cfg.pod_ip.is_some())
        .map_err(|e| AgentError::Config(e.to_string()))?;
    let shares = crate::flight::Shares::new(&cfg.metadata_url, scratch, f)
        .map_err(|e| AgentError::Config(e.to_string()))?;
    tracing::info!(%addr, tls = cfg.server.tls.is_some(), budget = f.budget, max_calls = f.max_calls, "flight listening");
    let task = tokio::spawn(async move {
        if let Err(e) = crate::flight::serve(listener, shares, shutdown).await {
            tracing::error!(error = %e, "the Arrow Flight server failed");
        }
    });
    Ok(Some((addr, task)))
}

/// Without the `flight` feature, `--flight-addr` is refused.
#[cfg(not(feature = "flight"))]
fn flight(cfg: &Config, _: CancellationToken) -> Result<FlightServer, AgentError> {
    match cfg.flight {
        None => Ok(None),
        Some(_) => Err(AgentError::Config(
            "this kt-agent was built without Arrow Flight (cargo feature `flight`): --flight-addr is not available".into(),
        )),
    }
}

/// Node-cache mode: the datasets below the root, fetched by a client that
/// is this agent's own (its token; its control socket, so every complete
/// version is exported here as a downloaded copy).
fn node_cache(
    cfg: &Config,
    nc: &crate::datasets::NodeCacheConfig,
    exports: Arc<Exports>,
) -> Result<Arc<NodeCache>, AgentError> {
    let mut client = kt_client::ClientConfig::new(&cfg.metadata_url, cfg.server.token.expose());
    client.token_file = nc.token_file.clone();
    client.agent_socket = cfg.socket.clone();
    client.serve_copies = true;
    client.cache_dir = None;
    let client = kt_client::Client::new(client)
        .map_err(|e| AgentError::Config(format!("the seeding client: {e}")))?;
    Ok(NodeCache::open(nc, client, exports)?)
}

/// Where tensor listeners bind: the pod IP, else the advertised URL's host
/// when it is an address.
fn tensor_ip(url: &str, pod_ip: Option<&str>) -> Option<String> {
    if let Some(ip) = pod_ip
        .map(str::trim)
        .filter(|p| p.parse::<std::net::IpAddr>().is_ok())
    {
        return Some(ip.to_owned());
    }
    let host = url.split("://").nth(1)?.split('/').next()?;
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next()?,
        None => host.rsplit_once(':').map(|(h, _)| h).unwrap_or(host),
    };
    host.parse::<std::net::IpAddr>()
        .ok()
        .map(|ip| ip.to_string())
}

/// An agent id is a pod name: what the metadata server accepts.
fn check_id(id: &str) -> Result<(), AgentError> {
    match kt_types::agent_id_problem(id) {
        None => Ok(()),
        Some(why) => Err(AgentError::Config(why)),
    }
}

/// Runs an agent until `shutdown` is cancelled.
pub async fn run(
    listener: TcpListener,
    cfg: Config,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    let handle = start(listener, cfg, shutdown)?;
    handle
        .task
        .await
        .map_err(|e| AgentError::Config(format!("agent task failed: {e}")))?
}

/// Releases read leases a crashed getter left idle.
async fn sweep(reads: Arc<Reads<Arc<Exports>>>, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let n = reads.sweep(Instant::now()).await;
        if n > 0 {
            tracing::info!(leases = n, "released idle read leases");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};

    use axum::Router;
    use axum::extract::{Path, State};
    use axum::http::StatusCode;
    use axum::routing::{post, put};
    use kt_service::Token;
    use kt_types::agent::{CONTROL_VERSION, ControlReply, ControlRequest, encode_frame, frame_len};
    use kt_types::api::{AgentHeartbeat, HeartbeatReply, RegisterKey};
    use kt_types::{ErrorCode, Key, KeyRecord, Lifespan};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::UnixStream;

    use super::*;

    /// A metadata server that records what agents send and answers `drop`
    /// as told; the first `fail` heartbeats get a 503.
    #[derive(Debug, Default)]
    struct Fake {
        beats: Mutex<Vec<AgentHeartbeat>>,
        keys: Mutex<Vec<(String, RegisterKey)>>,
        drop: Mutex<Vec<Key>>,
        fail: AtomicU64,
    }

    async fn beat(
        State(f): State<Arc<Fake>>,
        axum::Json(hb): axum::Json<AgentHeartbeat>,
    ) -> Result<axum::Json<HeartbeatReply>, StatusCode> {
        if f.fail
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(StatusCode::SERVICE_UNAVAILABLE);
        }
        f.beats.lock().unwrap().push(hb);
        Ok(axum::Json(HeartbeatReply {
            interval_ms: 20,
            ttl_ms: 1000,
            drop: std::mem::take(&mut *f.drop.lock().unwrap()),
            capability_keys: Vec::new(),
        }))
    }

    async fn register(
        State(f): State<Arc<Fake>>,
        Path(key): Path<String>,
        axum::Json(reg): axum::Json<RegisterKey>,
    ) -> axum::Json<KeyRecord> {
        f.keys.lock().unwrap().push((key.clone(), reg.clone()));
        axum::Json(KeyRecord {
            key: Key::parse(&key).unwrap(),
            locale: reg.locale,
            source: reg.source,
            holder: reg.holder.unwrap_or_default(),
            peers: Vec::new(),
            version: reg.version,
            is_dir: reg.is_dir,
            size: reg.size,
            files: reg.files,
            tensors: reg.tensors,
            digest: reg.digest,
            lifespan: Lifespan::Cluster,
            lifespan_by_rule: false,
            service: "s".into(),
            expires_at_ms: None,
            created_at_ms: 1,
            updated_at_ms: 1,
        })
    }

    async fn fake_metadata(f: Arc<Fake>) -> String {
        let app = Router::new()
            .route("/api/v1/agents", post(beat))
            .route("/api/v1/keys/{*key}", put(register))
            .with_state(f);
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        url
    }

    async fn agent(dir: &std::path::Path, metadata: &str) -> (AgentHandle, CancellationToken) {
        let mut cfg = Config::new(
            "pod-a",
            metadata,
            Token::new("t").unwrap(),
            dir.join("run/agent.sock"),
        );
        cfg.heartbeat = Duration::from_millis(20);
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stop = CancellationToken::new();
        (start(l, cfg, stop.clone()).unwrap(), stop)
    }

    async fn ask(s: &mut UnixStream, req: &ControlRequest) -> Option<ControlReply> {
        s.write_all(&encode_frame(req).unwrap()).await.ok()?;
        let mut head = [0u8; 4];
        s.read_exact(&mut head).await.ok()?;
        let mut body = vec![0; frame_len(head).unwrap()];
        s.read_exact(&mut body).await.ok()?;
        Some(serde_json::from_slice(&body).unwrap())
    }

    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn control_socket_handshake_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let fake = Arc::new(Fake::default());
        let (a, stop) = agent(dir.path(), &fake_metadata(fake).await).await;
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&a.socket).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);

        // Anything before hello is refused, and the connection closed.
        let mut s = UnixStream::connect(&a.socket).await.unwrap();
        let r = ask(&mut s, &ControlRequest::Status).await.unwrap();
        assert!(
            matches!(
                r,
                ControlReply::Error {
                    code: ErrorCode::InvalidRequest,
                    ..
                }
            ),
            "{r:?}"
        );
        assert!(ask(&mut s, &ControlRequest::Status).await.is_none());

        // A version we do not speak.
        let mut s = UnixStream::connect(&a.socket).await.unwrap();
        let r = ask(
            &mut s,
            &ControlRequest::Hello {
                version: 99,
                keepalive: false,
            },
        )
        .await
        .unwrap();
        match r {
            ControlReply::Error { code, message } => {
                assert_eq!(code, ErrorCode::InvalidRequest);
                assert!(message.contains("99"), "{message}");
            }
            other => panic!("{other:?}"),
        }

        // Many clients at once; relative paths and missing paths are errors.
        let mut clients = Vec::new();
        for _ in 0..8 {
            let mut s = UnixStream::connect(&a.socket).await.unwrap();
            let hello = ask(
                &mut s,
                &ControlRequest::Hello {
                    version: CONTROL_VERSION,
                    keepalive: false,
                },
            )
            .await;
            assert_eq!(
                hello,
                Some(ControlReply::Hello {
                    version: CONTROL_VERSION,
                    agent: "pod-a".into(),
                    url: a.url.clone(),
                    keepalive: false,
                    shm_dir: Some(
                        kt_tensor::shm::shm_dir()
                            .canonicalize()
                            .unwrap()
                            .display()
                            .to_string()
                    ),
                })
            );
            clients.push(s);
        }
        for (path, code) in [
            ("relative/path", ErrorCode::InvalidRequest),
            ("/does/not/exist", ErrorCode::NotFound),
        ] {
            let r = ask(
                &mut clients[3],
                &ControlRequest::ExportLocal {
                    key: Key::parse("a/b").unwrap(),
                    path: path.into(),
                    options: Default::default(),
                },
            )
            .await
            .unwrap();
            assert!(
                matches!(r, ControlReply::Error { code: c, .. } if c == code),
                "{path}: {r:?}"
            );
        }
        // Garbage is answered, and the connection stays usable.
        let s = &mut clients[5];
        s.write_all(&[0, 0, 0, 2, b'{', b'x']).await.unwrap();
        let mut head = [0u8; 4];
        s.read_exact(&mut head).await.unwrap();
        let mut body = vec![0; frame_len(head).unwrap()];
        s.read_exact(&mut body).await.unwrap();
        let r: ControlReply = serde_json::from_slice(&body).unwrap();
        assert!(matches!(
            r,
            ControlReply::Error {
                code: ErrorCode::InvalidRequest,
                ..
            }
        ));
        let r = ask(s, &ControlRequest::Status).await.unwrap();
        assert!(
            matches!(r, ControlReply::Status { ref exports, .. } if exports.is_empty()),
            "{r:?}"
        );

        // A second agent on the same socket is refused; after shutdown the socket is gone.
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let cfg = Config::new(
            "pod-b",
            "http://127.0.0.1:1",
            Token::new("t").unwrap(),
            &a.socket,
        );
        assert!(matches!(
            start(l, cfg, CancellationToken::new()),
            Err(AgentError::Socket(SocketError::InUse(_)))
        ));
        stop.cancel();
        a.task.await.unwrap().unwrap();
        assert!(!a.socket.exists());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn heartbeats_survive_outages_and_drop_what_they_are_told() {
        let dir = tempfile::tempdir().unwrap();
        let fake = Arc::new(Fake::default());
        fake.fail.store(3, Ordering::SeqCst);
        let url = fake_metadata(fake.clone()).await;
        // A stale socket file from a killed agent is replaced.
        let sock = dir.path().join("run/agent.sock");
        std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
        let (a, stop) = agent(dir.path(), &url).await;
        until("beats after an outage", || {
            a.heartbeats.failed.load(Ordering::SeqCst) >= 3
                && !fake.beats.lock().unwrap().is_empty()
        })
        .await;

        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("d")).unwrap();
        std::fs::write(tree.join("d/f"), b"hello").unwrap();
        let mut s = UnixStream::connect(&a.socket).await.unwrap();
        ask(
            &mut s,
            &ControlRequest::Hello {
                version: CONTROL_VERSION,
                keepalive: false,
            },
        )
        .await
        .unwrap();
        let key = Key::parse("team/data").unwrap();
        let r = ask(
            &mut s,
            &ControlRequest::ExportLocal {
                key: key.clone(),
                path: tree.display().to_string(),
                options: Default::default(),
            },
        )
        .await
        .unwrap();
        let ControlReply::Exported { export, record } = r else {
            panic!("{r:?}")
        };
        assert!(export.origin);
        assert_eq!((export.files, export.size), (1, 5));
        let record = record.unwrap();
        assert_eq!(record.holder, "pod-a");
        assert_eq!(record.source, a.url);
        let (_, reg) = fake.keys.lock().unwrap()[0].clone();
        assert_eq!(reg.locale, kt_types::Locale::Local);
        assert_eq!(reg.version, export.version);
        until("a beat announcing the export", || {
            fake.beats
                .lock()
                .unwrap()
                .iter()
                .any(|b| b.id == "pod-a" && b.url == a.url && b.serves.iter().any(|s| s.key == key))
        })
        .await;

        // The metadata server says the key is gone: the agent stops serving it.
        fake.drop.lock().unwrap().push(key.clone());
        until("the export dropped", || a.exports.is_empty()).await;
        assert_eq!(a.heartbeats.dropped.load(Ordering::SeqCst), 1);
        stop.cancel();
        a.task.await.unwrap().unwrap();
    }
}
