//! `kt-bench-metadata`: the metadata server under many concurrent lookups.
//!
//! A run starts a real metadata server in this process (or targets one given
//! by URL), seeds it with the keys of a [`Plan`] (store keys whose peers are
//! fake node agents that keep heartbeating through the run), then lets
//! `clients` workers do lookups for a warm-up and a measured window:
//!
//! - [`Op::Lease`], the getter's real path: `POST /api/v1/keys/{key}/lease`
//!   immediately followed by `DELETE /api/v1/leases/{id}` (one lookup per pair);
//! - [`Op::Stat`]: `GET /api/v1/keys/{key}`.
//!
//! Each worker is one client with one keep-alive HTTP/1.1 connection (hyper's
//! connection API, no pool), doing one request at a time on random keys from
//! its own seeded generator: the server sees `clients` independent getters,
//! and the generator spends as little CPU per request as a client can. Every
//! request's latency goes into the worker's [`Histogram`]; they are merged at
//! the end. The in-process server runs on a runtime of its own (threads named
//! `kt-meta-srv`, as many as there are cores, like the `kt-metadata` binary),
//! so on this machine server and load generator share the cores; the report
//! says how the CPU time split between them.
//!
//! [`joins`] is the broadcast join benchmark (`--joins N`): N getters holding
//! a WebSocket each join one broadcast group.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail, ensure};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST, HeaderValue};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use kt_service::Token;
use kt_types::api::{
    AgentHeartbeat, HeartbeatReply, RegisterKey, RegisterStore, Served, StoreLocation,
};
use kt_types::{KeyRecord, Locale, STORE_HOLDER, api::PutOptions};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::histogram::{Histogram, ms};
use crate::scratch::ScratchDir;

pub mod joins;

/// Token of the in-process server.
const TOKEN: &str = "bench";
/// Name of the in-process server's runtime threads (at most 15 bytes: the
/// kernel's thread name), by which their CPU time is told apart.
const SERVER_THREAD: &str = "kt-meta-srv";
/// Where the fake store "is": never contacted by lookups.
const FAKE_STORE_URL: &str = "http://fake-store.invalid:8080";
/// Connections that seed keys in parallel.
const SEED_CONNECTIONS: usize = 8;
/// Pause after a transport error, so a dead server is not hammered in a loop.
const ERROR_BACKOFF: Duration = Duration::from_millis(10);

/// What one lookup is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Lease a source, then release it at once.
    Lease,
    /// Read the key's record.
    Stat,
}

impl FromStr for Op {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "lease" => Ok(Op::Lease),
            "stat" => Ok(Op::Stat),
            other => Err(format!("unknown op {other:?} (lease or stat)")),
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Lease => "lease",
            Op::Stat => "stat",
        })
    }
}

/// Which server is loaded.
#[derive(Debug, Clone)]
pub enum Target {
    /// A metadata server started here, its state in a work directory under `dir`.
    InProcess { dir: PathBuf },
    /// A running server (`http://host:port`); seeding goes under a unique prefix.
    External { url: String, token: String },
}

#[derive(Debug, Clone)]
pub struct Options {
    pub target: Target,
    pub keys: usize,
    pub agents: usize,
    /// Agents serving each key (its peers besides the store).
    pub peers_per_key: usize,
    pub clients: usize,
    pub warmup: Duration,
    pub duration: Duration,
    pub op: Op,
    pub seed: u64,
}

/// What is seeded: `keys` store keys under `prefix`, and `agents` fake node
/// agents; key `k` is served by agents `k, k+1, …, k+peers_per_key-1` (mod
/// `agents`), so every key has the same number of peers and every agent
/// serves about `keys * peers_per_key / agents` keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    prefix: String,
    keys: usize,
    agents: usize,
    peers_per_key: usize,
}

impl Plan {
    pub fn new(
        prefix: &str,
        keys: usize,
        agents: usize,
        peers_per_key: usize,
    ) -> anyhow::Result<Self> {
        ensure!(keys > 0, "at least one key is needed");
        ensure!(
            peers_per_key <= agents,
            "{peers_per_key} peers per key need at least as many agents (have {agents})"
        );
        ensure!(
            !prefix.is_empty()
                && prefix
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')),
            "prefix {prefix:?} must be one key segment usable in an agent id"
        );
        Ok(Plan {
            prefix: prefix.to_owned(),
            keys,
            agents,
            peers_per_key,
        })
    }

    /// A prefix no earlier run used: `metaload-<pid>-<unix seconds>`.
    pub fn unique_prefix() -> String {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        format!("metaload-{}-{secs}", std::process::id())
    }

    /// The service every seeded key and agent belongs to (the key's first segment).
    pub fn service(&self) -> &str {
        &self.prefix
    }

    pub fn keys(&self) -> usize {
        self.keys
    }

    pub fn agents(&self) -> usize {
        self.agents
    }

    pub fn key(&self, k: usize) -> String {
        format!("{}/k{k:06}", self.prefix)
    }

    pub fn agent_id(&self, a: usize) -> String {
        format!("{}-agent-{a:03}", self.prefix)
    }

    /// A URL nobody answers on: lookups hand it out, nothing fetches from it.
    pub fn agent_url(&self, a: usize) -> String {
        format!("http://{}.invalid:8082", self.agent_id(a))
    }

    /// The agents serving key `k`.
    pub fn peers_of(&self, k: usize) -> Vec<usize> {
        (0..self.peers_per_key)
            .map(|j| (k + j) % self.agents)
            .collect()
    }

    /// The keys agent `a` serves, ascending.
    pub fn served_by(&self, a: usize) -> Vec<usize> {
        (0..self.keys)
            .filter(|k| (a + self.agents - k % self.agents) % self.agents < self.peers_per_key)
            .collect()
    }

    /// The version every seeded key is at.
    pub fn version(&self) -> String {
        format!("{}-v1", self.prefix)
    }

    pub fn register_body(&self, store_url: &str) -> RegisterKey {
        RegisterKey {
            locale: Locale::Store,
            source: store_url.to_owned(),
            holder: None,
            version: self.version(),
            is_dir: true,
            size: 4096,
            files: 1,
            tensors: None,
            // Never read: the load measures the metadata server alone.
            digest: Some(kt_types::Hash([0; 32])),
            options: PutOptions::default(),
            only_if: None,
        }
    }

    pub fn heartbeat(&self, a: usize) -> AgentHeartbeat {
        AgentHeartbeat {
            id: self.agent_id(a),
            url: self.agent_url(a),
            service: Some(self.service().to_owned()),
            serves: self
                .served_by(a)
                .into_iter()
                .filter_map(|k| {
                    kt_types::Key::parse(&self.key(k)).ok().map(|key| Served {
                        key,
                        version: self.version(),
                    })
                })
                .collect(),
        }
    }
}

/// Errors seen: how many, and the first one's message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Errors {
    pub count: u64,
    pub first: Option<String>,
}

impl Errors {
    fn add(&mut self, msg: String) {
        self.count += 1;
        if self.first.is_none() {
            self.first = Some(msg);
        }
    }

    fn merge(&mut self, other: Errors) {
        self.count += other.count;
        if self.first.is_none() {
            self.first = other.first;
        }
    }
}

/// Where requests go, with the headers every request carries.
#[derive(Debug, Clone)]
struct Endpoint {
    host: String,
    port: u16,
    authority: HeaderValue,
    auth: HeaderValue,
}

impl Endpoint {
    fn new(url: &str, token: &str) -> anyhow::Result<Self> {
        let uri: Uri = url
            .trim_end_matches('/')
            .parse()
            .with_context(|| format!("server URL {url:?}"))?;
        ensure!(
            uri.scheme_str() == Some("http"),
            "server URL {url:?}: only http:// is supported"
        );
        ensure!(
            uri.path() == "/" || uri.path().is_empty(),
            "server URL {url:?}: give the server's base URL, without a path"
        );
        let Some(authority) = uri.authority() else {
            bail!("server URL {url:?} has no host");
        };
        Ok(Endpoint {
            host: authority.host().trim_matches(['[', ']']).to_owned(),
            port: authority.port_u16().unwrap_or(80),
            authority: HeaderValue::from_str(authority.as_str())?,
            auth: HeaderValue::from_str(&format!("Bearer {token}"))
                .context("the token is not a valid header value")?,
        })
    }
}

/// One client: one keep-alive HTTP/1.1 connection, one request at a time,
/// reconnecting after a connection error.
#[derive(Debug)]
struct Conn {
    ep: Arc<Endpoint>,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl Conn {
    fn new(ep: Arc<Endpoint>) -> Self {
        Conn { ep, sender: None }
    }

    async fn connect(ep: &Endpoint) -> Result<SendRequest<Full<Bytes>>, String> {
        let stream = TcpStream::connect((ep.host.as_str(), ep.port))
            .await
            .map_err(|e| format!("connecting to {}:{}: {e}", ep.host, ep.port))?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("TCP_NODELAY: {e}"))?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP handshake: {e}"))?;
        tokio::spawn(async move {
            // Ends when the sender is dropped or the server closes.
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// Sends one request; answers its status and body. An `Err` is a
    /// transport failure (the connection is then replaced on the next call).
    async fn send(
        &mut self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<(StatusCode, Bytes), String> {
        let mut sender = match self.sender.take() {
            Some(s) if !s.is_closed() => s,
            _ => Self::connect(&self.ep).await?,
        };
        let mut req = Request::builder()
            .method(method.clone())
            .uri(path)
            .header(HOST, self.ep.authority.clone())
            .header(AUTHORIZATION, self.ep.auth.clone());
        if body.is_some() {
            req = req.header(CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(body.unwrap_or_default()))
            .map_err(|e| format!("{method} {path}: building the request: {e}"))?;
        sender
            .ready()
            .await
            .map_err(|e| format!("{method} {path}: connection: {e}"))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| format!("{method} {path}: {e}"))?;
        let (parts, body) = resp.into_parts();
        let bytes = body
            .collect()
            .await
            .map_err(|e| format!("{method} {path}: reading the answer: {e}"))?
            .to_bytes();
        self.sender = Some(sender);
        Ok((parts.status, bytes))
    }

    /// Sends and requires `want`; the error names the request and the answer.
    async fn call(
        &mut self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
        want: StatusCode,
    ) -> Result<Bytes, String> {
        let (status, bytes) = self.send(method.clone(), path, body).await?;
        if status == want {
            Ok(bytes)
        } else {
            Err(bad_status(&method, path, status, &bytes))
        }
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &mut self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> anyhow::Result<T> {
        let bytes = self
            .call(method.clone(), path, body, StatusCode::OK)
            .await
            .map_err(anyhow::Error::msg)?;
        serde_json::from_slice(&bytes).with_context(|| format!("{method} {path}: the answer"))
    }
}

fn bad_status(method: &Method, path: &str, status: StatusCode, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text: String = text.chars().take(300).collect();
    format!("{method} {path}: HTTP {status}: {text}")
}

fn json_body<T: serde::Serialize>(v: &T) -> anyhow::Result<Bytes> {
    Ok(Bytes::from(serde_json::to_vec(v)?))
}

/// A metadata server on a runtime and threads of its own, state in a work
/// directory; told to stop when dropped.
#[derive(Debug)]
struct InProcessServer {
    url: String,
    shutdown: CancellationToken,
    _stop_on_drop: DropGuard,
    thread: Option<std::thread::JoinHandle<Result<(), kt_metadata::MetadataError>>>,
    // Last: removed after the server stopped writing into it.
    _dir: ScratchDir,
}

impl InProcessServer {
    fn start(parent: &Path) -> anyhow::Result<Self> {
        let dir = ScratchDir::create(parent)?;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").context("binding")?;
        listener.set_nonblocking(true)?;
        let url = format!("http://{}", listener.local_addr()?);
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(SERVER_THREAD)
            .enable_all()
            .build()
            .context("the server's runtime")?;
        let config = kt_metadata::Config::new(dir.path().join("metadata"), Token::new(TOKEN)?);
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        let thread = std::thread::Builder::new()
            .name(SERVER_THREAD.to_owned())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener)?;
                    kt_metadata::run(listener, config, stop).await
                })
            })
            .context("starting the server thread")?;
        Ok(InProcessServer {
            url,
            _stop_on_drop: shutdown.clone().drop_guard(),
            shutdown,
            thread: Some(thread),
            _dir: dir,
        })
    }

    fn check_running(&self) -> anyhow::Result<()> {
        if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
            bail!("the metadata server stopped");
        }
        Ok(())
    }

    async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        if let Some(t) = self.thread.take() {
            let joined = kt_sync::task::spawn(move || t.join())
                .await
                .context("joining the server thread")?;
            match joined {
                Ok(r) => r.context("metadata server")?,
                Err(_) => bail!("the metadata server thread panicked"),
            }
        }
        Ok(())
    }
}

/// The parts of a lease answer the load generator reads.
#[derive(Debug, Deserialize)]
struct LeaseReply {
    lease: String,
    source: LeaseSource,
}

#[derive(Debug, Deserialize)]
struct LeaseSource {
    id: String,
}

/// What a seeding left behind.
#[derive(Debug)]
struct Seeded {
    /// Heartbeat bodies, one per agent, sent again through the run.
    beats: Vec<Bytes>,
    interval: Duration,
    /// The keys name the server's own store (not the fake one), which can
    /// delete them.
    real_store: bool,
}

/// Registers the store (unless the server has one), the keys, and the agents'
/// first beats; checks that a key lists its peers.
async fn seed(ep: &Arc<Endpoint>, plan: &Plan, external: bool) -> anyhow::Result<Seeded> {
    let mut conn = Conn::new(ep.clone());
    // A server that already has a store keeps it: registering ours would
    // send its real puts to nowhere. Keys then name that store as source
    // (and can be deleted through it at the end).
    let (status, body) = conn
        .send(Method::GET, "/api/v1/store", None)
        .await
        .map_err(anyhow::Error::msg)?;
    let real_store = match status {
        StatusCode::OK if external => {
            let loc: StoreLocation = serde_json::from_slice(&body).context("GET /api/v1/store")?;
            Some(loc.url)
        }
        StatusCode::OK | StatusCode::SERVICE_UNAVAILABLE => None,
        _ => bail!(bad_status(&Method::GET, "/api/v1/store", status, &body)),
    };
    let store_url = match &real_store {
        Some(url) => url.clone(),
        None => {
            let reg = json_body(&RegisterStore {
                url: FAKE_STORE_URL.to_owned(),
            })?;
            conn.call(
                Method::POST,
                "/api/v1/stores",
                Some(reg),
                StatusCode::NO_CONTENT,
            )
            .await
            .map_err(anyhow::Error::msg)?;
            FAKE_STORE_URL.to_owned()
        }
    };

    let body = json_body(&plan.register_body(&store_url))?;
    let mut tasks = JoinSet::new();
    for t in 0..SEED_CONNECTIONS.min(plan.keys()) {
        let (ep, plan, body) = (ep.clone(), plan.clone(), body.clone());
        tasks.spawn(async move {
            let mut conn = Conn::new(ep);
            for k in (t..plan.keys()).step_by(SEED_CONNECTIONS) {
                let path = format!("/api/v1/keys/{}", plan.key(k));
                conn.call(Method::PUT, &path, Some(body.clone()), StatusCode::OK)
                    .await?;
            }
            Ok::<_, String>(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.context("a seeding task")?.map_err(anyhow::Error::msg)?;
    }

    let mut beats = Vec::with_capacity(plan.agents());
    let mut interval = Duration::from_secs(2);
    for a in 0..plan.agents() {
        let beat = json_body(&plan.heartbeat(a))?;
        let reply: HeartbeatReply = conn
            .json(Method::POST, "/api/v1/agents", Some(beat.clone()))
            .await?;
        ensure!(
            reply.drop.is_empty(),
            "agent {} was told to drop {} of the keys it serves (first: {:?})",
            plan.agent_id(a),
            reply.drop.len(),
            reply.drop.first()
        );
        interval = Duration::from_millis(reply.interval_ms.max(100));
        beats.push(beat);
    }

    // Every key lists its peers: check one.
    let record: KeyRecord = conn
        .json(Method::GET, &format!("/api/v1/keys/{}", plan.key(0)), None)
        .await?;
    let mut want: Vec<String> = plan.peers_of(0).iter().map(|&a| plan.agent_id(a)).collect();
    want.sort();
    let got: Vec<String> = record.peers.iter().map(|p| p.id.clone()).collect();
    ensure!(
        got == want,
        "{} lists peers {got:?}, seeded {want:?}",
        plan.key(0)
    );
    if external {
        println!("seeded under {}/ (store {store_url})", plan.service());
    }
    Ok(Seeded {
        beats,
        interval,
        real_store: real_store.is_some(),
    })
}

/// Beats for every agent at the server's interval until `stop`, so the fake
/// agents stay live sources through the run.
async fn keep_beating(
    ep: Arc<Endpoint>,
    beats: Vec<Bytes>,
    every: Duration,
    stop: CancellationToken,
) -> (u64, Errors) {
    let mut conn = Conn::new(ep);
    let mut tick = tokio::time::interval(every);
    tick.tick().await; // The first tick is immediate; the seeding just beat.
    let (mut sent, mut errors) = (0, Errors::default());
    loop {
        tokio::select! {
            _ = stop.cancelled() => return (sent, errors),
            _ = tick.tick() => {}
        }
        for beat in &beats {
            match conn
                .call(
                    Method::POST,
                    "/api/v1/agents",
                    Some(beat.clone()),
                    StatusCode::OK,
                )
                .await
            {
                Ok(_) => sent += 1,
                Err(e) => errors.add(format!("heartbeat: {e}")),
            }
        }
    }
}

/// What the workers share.
#[derive(Debug)]
struct Work {
    ep: Arc<Endpoint>,
    op: Op,
    /// Per key: the lease path or the stat path, by `op`.
    paths: Vec<String>,
    measure_from: Instant,
    until: Instant,
    seed: u64,
}

/// One worker's tallies.
#[derive(Debug)]
struct WorkerStats {
    /// Latency of the lookup request (lease or stat).
    first: Histogram,
    /// Latency of the release (lease mode).
    release: Histogram,
    /// Lease + release, back to back (lease mode).
    pair: Histogram,
    lookups: u64,
    /// Leases that named a peer rather than the store.
    to_peers: u64,
    errors: Errors,
    last_done: Option<Instant>,
}

async fn worker(work: Arc<Work>, index: usize) -> WorkerStats {
    let mut conn = Conn::new(work.ep.clone());
    let mut rng = SmallRng::seed_from_u64(work.seed.wrapping_add(index as u64));
    let mut st = WorkerStats {
        first: Histogram::new(),
        release: Histogram::new(),
        pair: Histogram::new(),
        lookups: 0,
        to_peers: 0,
        errors: Errors::default(),
        last_done: None,
    };
    let lease_body = Bytes::from_static(b"{}");
    loop {
        let t0 = Instant::now();
        if t0 >= work.until {
            return st;
        }
        let measured = t0 >= work.measure_from;
        let path = &work.paths[rng.random_range(0..work.paths.len())];
        let (method, body) = match work.op {
            Op::Lease => (Method::POST, Some(lease_body.clone())),
            Op::Stat => (Method::GET, None),
        };
        let sent = conn.send(method.clone(), path, body).await;
        let t1 = Instant::now();
        let bytes = match sent {
            Ok((status, bytes)) => {
                if measured {
                    st.first.record_duration(t1 - t0);
                }
                if status != StatusCode::OK {
                    st.errors.add(bad_status(&method, path, status, &bytes));
                    continue;
                }
                bytes
            }
            Err(e) => {
                st.errors.add(e);
                tokio::time::sleep(ERROR_BACKOFF).await;
                continue;
            }
        };
        if work.op == Op::Stat {
            if measured {
                st.lookups += 1;
                st.last_done = Some(t1);
            }
            continue;
        }
        let lease = match serde_json::from_slice::<LeaseReply>(&bytes) {
            Ok(l) => l,
            Err(e) => {
                st.errors.add(format!("POST {path}: the answer: {e}"));
                continue;
            }
        };
        let release = format!("/api/v1/leases/{}", lease.lease);
        let sent = conn.send(Method::DELETE, &release, None).await;
        let t2 = Instant::now();
        match sent {
            Ok((status, bytes)) => {
                if measured {
                    st.release.record_duration(t2 - t1);
                }
                if status != StatusCode::NO_CONTENT {
                    st.errors
                        .add(bad_status(&Method::DELETE, &release, status, &bytes));
                    continue;
                }
            }
            Err(e) => {
                st.errors.add(e);
                tokio::time::sleep(ERROR_BACKOFF).await;
                continue;
            }
        }
        if measured {
            st.pair.record_duration(t2 - t0);
            st.lookups += 1;
            st.to_peers += u64::from(lease.source.id != STORE_HOLDER);
            st.last_done = Some(t2);
        }
    }
}

/// CPU time (user + system) of this process's threads, split into the
/// in-process server's and everything else; Linux only.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuSplit {
    pub server_s: f64,
    pub other_s: f64,
}

/// Reads `/proc/self/task/*/stat` (times in USER_HZ, 100 on Linux).
fn cpu_split() -> Option<CpuSplit> {
    let mut split = CpuSplit::default();
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let Ok(stat) = std::fs::read_to_string(task.ok()?.path().join("stat")) else {
            continue; // The thread ended meanwhile.
        };
        if let Some((name, secs)) = parse_task_stat(&stat) {
            if name.starts_with(SERVER_THREAD) {
                split.server_s += secs;
            } else {
                split.other_s += secs;
            }
        }
    }
    Some(split)
}

/// The thread name and its user + system CPU seconds from a `stat` line.
pub fn parse_task_stat(stat: &str) -> Option<(&str, f64)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let name = stat.get(open + 1..close)?;
    // After the name: state (field 3), …, utime (14), stime (15).
    let fields: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((name, (utime + stime) as f64 / 100.0))
}

/// Everything a run measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub op: Op,
    pub clients: usize,
    pub in_process: bool,
    pub cores: usize,
    /// From the start of the measurement to the last measured completion.
    pub window: Duration,
    pub lookups: u64,
    pub to_peers: u64,
    /// Latency histograms by request kind (`lease`, `release`, `stat`), and
    /// `lease+release` for whole lease lookups.
    pub kinds: BTreeMap<&'static str, Histogram>,
    /// Every request, merged.
    pub requests: Histogram,
    pub errors: Errors,
    pub heartbeats: u64,
    /// CPU seconds during the measured window (in-process: server and the rest).
    pub cpu: Option<CpuSplit>,
    pub cleanup: Option<String>,
}

/// `count` per second over `elapsed`; 0 over no time.
fn per_second(count: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 { count as f64 / secs } else { 0.0 }
}

impl Outcome {
    pub fn lookups_per_s(&self) -> f64 {
        per_second(self.lookups, self.window)
    }

    /// `metadata lookups_per_s=N p99_ms=X clients=C op=OP` (p99 of every request).
    pub fn summary_line(&self) -> String {
        format!(
            "metadata lookups_per_s={:.0} p99_ms={:.2} clients={} op={}",
            self.lookups_per_s(),
            ms(self.requests.percentile(99.0)),
            self.clients,
            self.op
        )
    }

    /// The report above the summary line.
    pub fn report(&self) -> String {
        let mut out = String::new();
        let secs = self.window.as_secs_f64();
        let _ = writeln!(
            out,
            "{:<14} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9}",
            "requests", "count", "per s", "p50 ms", "p95 ms", "p99 ms", "max ms"
        );
        let mut row = |name: &str, h: &Histogram| {
            let _ = writeln!(
                out,
                "{name:<14} {:>10} {:>10.0} {:>9.3} {:>9.3} {:>9.3} {:>9.3}",
                h.count(),
                per_second(h.count(), self.window),
                ms(h.percentile(50.0)),
                ms(h.percentile(95.0)),
                ms(h.percentile(99.0)),
                ms(h.max()),
            );
        };
        for (name, h) in &self.kinds {
            row(name, h);
        }
        row("all requests", &self.requests);
        let _ = writeln!(
            out,
            "lookups: {} in {:.2} s = {:.0}/s ({} clients, op {})",
            self.lookups,
            secs,
            self.lookups_per_s(),
            self.clients,
            self.op
        );
        if self.op == Op::Lease && self.lookups > 0 {
            let _ = writeln!(
                out,
                "leases handed to peers: {:.1}% (the rest to the store)",
                100.0 * self.to_peers as f64 / self.lookups as f64
            );
        }
        let _ = writeln!(out, "agent heartbeats during the run: {}", self.heartbeats);
        if let Some(cpu) = self.cpu.filter(|_| secs > 0.0) {
            let pct = |s: f64| 100.0 * s / secs;
            if self.in_process {
                let _ = writeln!(
                    out,
                    "cpu while measuring: server {:.0}%, load generator {:.0}% (of {}%: {} cores)",
                    pct(cpu.server_s),
                    pct(cpu.other_s),
                    self.cores * 100,
                    self.cores
                );
            } else {
                let _ = writeln!(
                    out,
                    "cpu while measuring: load generator {:.0}% (of {}%: {} cores)",
                    pct(cpu.other_s),
                    self.cores * 100,
                    self.cores
                );
            }
        }
        let note = if self.in_process {
            "note: the server runs in this process on its own runtime; it shares the \
             machine's cores with the load generator, whose CPU use counts against it"
        } else {
            "note: if the server runs on this machine, it shares the cores with the load generator"
        };
        let _ = writeln!(out, "{note}");
        if let Some(c) = &self.cleanup {
            let _ = writeln!(out, "warning: {c}");
        }
        let _ = writeln!(out, "errors: {}", self.errors.count);
        if let Some(first) = &self.errors.first {
            let _ = writeln!(out, "first error: {first}");
        }
        out
    }
}

/// Seeds the server, runs the load, and collects the figures. Lookup errors
/// are reported in the outcome (they are not an `Err`).
pub async fn run(opts: &Options) -> anyhow::Result<Outcome> {
    ensure!(opts.clients > 0, "at least one client is needed");
    ensure!(
        !opts.duration.is_zero(),
        "the measured duration must be positive"
    );
    let plan = Plan::new(
        &Plan::unique_prefix(),
        opts.keys,
        opts.agents,
        opts.peers_per_key,
    )?;
    let (server, ep) = match &opts.target {
        Target::InProcess { dir } => {
            let server = InProcessServer::start(dir)?;
            let ep = Endpoint::new(&server.url, TOKEN)?;
            println!("metadata server in process at {}", server.url);
            (Some(server), ep)
        }
        Target::External { url, token } => (None, Endpoint::new(url, token)?),
    };
    let ep = Arc::new(ep);
    let external = server.is_none();
    wait_ready(&ep, server.as_ref()).await?;

    let started = Instant::now();
    let seeded = seed(&ep, &plan, external).await?;
    println!(
        "seeded {} keys, {} agents ({} peers per key) in {:.1} s",
        plan.keys(),
        plan.agents(),
        opts.peers_per_key,
        started.elapsed().as_secs_f64()
    );

    let stop_beats = CancellationToken::new();
    let real_store = seeded.real_store;
    let beating = tokio::spawn(keep_beating(
        ep.clone(),
        seeded.beats,
        seeded.interval,
        stop_beats.clone(),
    ));

    let paths = (0..plan.keys())
        .map(|k| match opts.op {
            Op::Lease => format!("/api/v1/keys/{}/lease", plan.key(k)),
            Op::Stat => format!("/api/v1/keys/{}", plan.key(k)),
        })
        .collect();
    let now = Instant::now();
    let work = Arc::new(Work {
        ep: ep.clone(),
        op: opts.op,
        paths,
        measure_from: now + opts.warmup,
        until: now + opts.warmup + opts.duration,
        seed: opts.seed,
    });
    println!(
        "{} clients, op {}: warm-up {:.0} s, then measuring {:.0} s",
        opts.clients,
        opts.op,
        opts.warmup.as_secs_f64(),
        opts.duration.as_secs_f64()
    );
    let mut workers = JoinSet::new();
    for i in 0..opts.clients {
        workers.spawn(worker(work.clone(), i));
    }
    // CPU time over the measured window, sampled at its edges.
    let cpu = tokio::spawn(async move {
        tokio::time::sleep_until(work.measure_from.into()).await;
        let before = cpu_split()?;
        tokio::time::sleep_until(work.until.into()).await;
        let after = cpu_split()?;
        Some(CpuSplit {
            server_s: after.server_s - before.server_s,
            other_s: after.other_s - before.other_s,
        })
    });

    let mut stats = Vec::with_capacity(opts.clients);
    while let Some(r) = workers.join_next().await {
        stats.push(r.context("a load worker")?);
    }
    let cpu = cpu.await.context("the CPU sampler")?;
    stop_beats.cancel();
    let (heartbeats, beat_errors) = beating.await.context("the heartbeat task")?;

    let mut outcome = collect(opts, &stats, now + opts.warmup, server.is_some());
    outcome.cpu = cpu;
    outcome.heartbeats = heartbeats;
    outcome.errors.merge(beat_errors);
    if external {
        outcome.cleanup = cleanup(&ep, &plan, real_store).await.err().map(|e| {
            format!(
                "could not remove what was seeded under {}/: {e:#}",
                plan.service()
            )
        });
    }
    if let Some(server) = server {
        server.stop().await?;
    }
    Ok(outcome)
}

/// Polls `/readyz` until the server answers (up to 30 s).
async fn wait_ready(ep: &Arc<Endpoint>, server: Option<&InProcessServer>) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut conn = Conn::new(ep.clone());
    loop {
        let last = match conn.send(Method::GET, "/readyz", None).await {
            Ok((StatusCode::OK, _)) => return Ok(()),
            Ok((status, body)) => bad_status(&Method::GET, "/readyz", status, &body),
            Err(e) => e,
        };
        if let Some(s) = server {
            s.check_running()?;
        }
        if Instant::now() >= deadline {
            bail!("the metadata server is not ready: {last}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Tears down the seeding's service (its agents stop being sources) and
/// deletes its keys, which only the store they name can do: keys naming the
/// fake store are left to the operator.
async fn cleanup(ep: &Arc<Endpoint>, plan: &Plan, real_store: bool) -> anyhow::Result<()> {
    let mut conn = Conn::new(ep.clone());
    let service = format!("/api/v1/services/{}", plan.service());
    conn.call(Method::DELETE, &service, None, StatusCode::OK)
        .await
        .map_err(anyhow::Error::msg)?;
    ensure!(
        real_store,
        "the server had no store, so a fake one was registered ({FAKE_STORE_URL}), and \
         deletes of store keys go through the store: the keys are left (the fake agents \
         were torn down); use a throwaway server"
    );
    let keys = format!("/api/v1/keys/{}?recursive=true", plan.service());
    conn.call(Method::DELETE, &keys, None, StatusCode::OK)
        .await
        .map_err(anyhow::Error::msg)?;
    Ok(())
}

fn collect(
    opts: &Options,
    stats: &[WorkerStats],
    measure_from: Instant,
    in_process: bool,
) -> Outcome {
    let mut first = Histogram::new();
    let mut release = Histogram::new();
    let mut pair = Histogram::new();
    let mut errors = Errors::default();
    let (mut lookups, mut to_peers) = (0, 0);
    let mut last = None;
    for s in stats {
        first.merge(&s.first);
        release.merge(&s.release);
        pair.merge(&s.pair);
        errors.merge(s.errors.clone());
        lookups += s.lookups;
        to_peers += s.to_peers;
        last = last.max(s.last_done);
    }
    let window = last.map_or(opts.duration, |t| t.saturating_duration_since(measure_from));
    let mut requests = first.clone();
    requests.merge(&release);
    let mut kinds = BTreeMap::new();
    match opts.op {
        Op::Lease => {
            kinds.insert("lease", first);
            kinds.insert("release", release);
            kinds.insert("lease+release", pair);
        }
        Op::Stat => {
            kinds.insert("stat", first);
        }
    }
    Outcome {
        op: opts.op,
        clients: opts.clients,
        in_process,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        window,
        lookups,
        to_peers,
        kinds,
        requests,
        errors,
        heartbeats: 0,
        cpu: None,
        cleanup: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_gives_every_key_its_peers() {
        let plan = Plan::new("metaload-1-2", 1000, 20, 3).unwrap();
        let mut served_total = 0;
        let mut peers_from_agents = vec![Vec::new(); plan.keys()];
        for a in 0..plan.agents() {
            let keys = plan.served_by(a);
            // Balanced: 1000 * 3 / 20 each.
            assert_eq!(keys.len(), 150, "agent {a}");
            served_total += keys.len();
            for k in keys {
                peers_from_agents[k].push(a);
            }
        }
        assert_eq!(served_total, 3000);
        for (k, from_agents) in peers_from_agents.iter_mut().enumerate() {
            let mut want = plan.peers_of(k);
            want.sort_unstable();
            assert_eq!(*from_agents, want, "key {k}");
            want.dedup();
            assert_eq!(want.len(), 3, "key {k}: distinct peers");
        }
        assert_eq!(plan.peers_of(19), vec![19, 0, 1]);
    }

    #[test]
    fn plan_names_are_valid() {
        let plan = Plan::new("metaload-42-1700000000", 3, 2, 2).unwrap();
        let key = kt_types::Key::parse(&plan.key(2)).unwrap();
        assert_eq!(key.as_str(), "metaload-42-1700000000/k000002");
        assert_eq!(key.service(), plan.service());
        assert_eq!(plan.agent_id(1), "metaload-42-1700000000-agent-001");
        assert!(plan.agent_url(1).starts_with("http://"));
        let beat = plan.heartbeat(1);
        assert_eq!(beat.serves.len(), 3);
        assert!(beat.serves.iter().all(|s| s.version == plan.version()));
        let reg = plan.register_body(FAKE_STORE_URL);
        assert_eq!((reg.locale, reg.holder), (Locale::Store, None));
        assert!(Plan::unique_prefix().starts_with("metaload-"));
        Plan::new(&Plan::unique_prefix(), 1, 0, 0).unwrap();
    }

    #[test]
    fn plan_refuses_impossible_seedings() {
        assert!(Plan::new("p", 0, 20, 3).is_err());
        assert!(Plan::new("p", 10, 2, 3).is_err());
        assert!(Plan::new("a/b", 10, 20, 3).is_err());
        assert!(Plan::new("", 10, 20, 3).is_err());
    }

    #[test]
    fn op_round_trips() {
        for op in [Op::Lease, Op::Stat] {
            assert_eq!(op.to_string().parse::<Op>().unwrap(), op);
        }
        assert!("get".parse::<Op>().is_err());
    }

    #[test]
    fn endpoint_from_url() {
        let ep = Endpoint::new("http://127.0.0.1:8081/", "t").unwrap();
        assert_eq!((ep.host.as_str(), ep.port), ("127.0.0.1", 8081));
        assert_eq!(ep.authority, "127.0.0.1:8081");
        assert_eq!(ep.auth, "Bearer t");
        assert_eq!(Endpoint::new("http://meta", "t").unwrap().port, 80);
        assert_eq!(Endpoint::new("http://[::1]:9/", "t").unwrap().host, "::1");
        assert!(Endpoint::new("https://meta:443", "t").is_err());
        assert!(Endpoint::new("http://meta/api", "t").is_err());
    }

    #[test]
    fn task_stat_parsing() {
        let line = "1234 (kt-meta-srv) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0";
        assert_eq!(parse_task_stat(line), Some(("kt-meta-srv", 3.0)));
        // A name with spaces and parentheses.
        let line = "1 (a (b) c) R 1 2 3 4 5 6 7 8 9 10 1 2 0";
        assert_eq!(parse_task_stat(line), Some(("a (b) c", 0.03)));
        assert_eq!(parse_task_stat("garbage"), None);
    }

    fn outcome(op: Op) -> Outcome {
        let mut h = Histogram::new();
        for _ in 0..1000 {
            h.record(2_500_000);
        }
        let opts = Options {
            target: Target::InProcess { dir: "/tmp".into() },
            keys: 1,
            agents: 0,
            peers_per_key: 0,
            clients: 200,
            warmup: Duration::ZERO,
            duration: Duration::from_secs(10),
            op,
            seed: 1,
        };
        let mut o = collect(&opts, &[], Instant::now(), true);
        o.lookups = 250_000;
        o.requests = h;
        o
    }

    #[test]
    fn summary_line_format() {
        let o = outcome(Op::Lease);
        assert_eq!(o.window, Duration::from_secs(10));
        assert_eq!(
            o.summary_line(),
            "metadata lookups_per_s=25000 p99_ms=2.50 clients=200 op=lease"
        );
        assert!(outcome(Op::Stat).summary_line().ends_with(" op=stat"));
    }

    #[test]
    fn report_shows_errors() {
        let mut o = outcome(Op::Stat);
        assert!(o.report().contains("errors: 0\n"));
        o.errors.add("GET /x: HTTP 500".into());
        o.errors.add("second".into());
        let r = o.report();
        assert!(
            r.contains("errors: 2\nfirst error: GET /x: HTTP 500\n"),
            "{r}"
        );
    }
}
