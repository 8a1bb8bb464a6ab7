//! GPU data in the agent: tensor registrations, point-to-point sessions,
//! and quorum transfers ([`kt_types::tensor`]).
//!
//! - **Registrations.** An application lends its tensors by handle over the
//!   control socket (`put_tensors`). Memory stays the application's; the
//!   agent maps it for each transfer (the backends cache what is expensive
//!   to open, as CUDA IPC handles). A registration belongs to the process on
//!   the other end of the socket (its pid from the peer credentials, with its
//!   start time so a reused pid is not mistaken for it); when the agent
//!   cannot see the pid (another pid namespace) it belongs to the
//!   connection. [`reap_loop`] drops registrations of processes that exited
//!   and unregisters their keys at the metadata server (that version only).
//!   Registrations are persisted in the state directory: an agent restarted
//!   while their processes live serves them again.
//! - **Point to point.** A getter's agent asks the metadata server for the
//!   key's holder and a capability to read it there
//!   (`POST /api/v1/tensors/grants/{key}`), and posts
//!   `POST /api/v1/tensors/sessions` to the holder's agent with the keys,
//!   its destination layouts and their capabilities (several keys of one
//!   source in one session), never its bearer token. The source checks
//!   them, answers with a plan of two ranks (itself rank 0), and both run
//!   it. A key held by this agent is copied locally.
//! - **Quorums.** With a broadcast window, the agent joins the metadata
//!   server's quorum (`/api/v1/quorums/...`) as putter or getter, gets its
//!   rank and the plan when the quorum closes, exchanges the backend's
//!   rendezvous (NCCL's unique id) through it, runs the plan and reports.
//!   An NCCL rank keeps its communicator for the group's next round
//!   (`comms`): the same members reuse it, with no rendezvous. Each process
//!   of the pod is a member of its own (its pid, with its label), so the
//!   agent may run several ranks of one transfer, one per process, each on
//!   its own thread, endpoint and (NCCL) communicator. A broadcast put of a
//!   key another process of the pod holds (or the same process puts in a
//!   broadcast still running) is one more putter: its memory is lent for
//!   the transfer only, and the registration stays the holder's. A
//!   broadcast get may ask for every putter's tensors of a key, or some by
//!   rank, or their sum or mean (`TensorGet::from`).
//!
//! Every transfer runs on a blocking thread with a timeout; a failure (a
//! peer gone, an NCCL error) is an error for the application that asked,
//! never the agent's end.
//!
//! The parts, one module each: `registrations` (owners, the registry and
//! its persistence, puts and drops, the reaper), `p2p` (gets, and the source
//! side of sessions), `quorum` (membership: joins, rendezvous, done reports)
//! `comms` (communicators kept between rounds) and `http` (the route). This module holds [`Tensors`], its settings and
//! what the parts share: backends, mapping lent memory, blocking threads.

mod comms;
mod http;
mod p2p;
mod quorum;
mod registrations;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kt_service::ApiError;
use kt_tensor::{Backend, HostBackend, TransportError};
use kt_types::tensor::{Device, MemHandle, TensorEntry};
use kt_types::{ErrorCode, Key};
use tokio::sync::Notify;

pub use self::http::routes;
pub use self::quorum::auto_group;
pub use self::registrations::{Owner, Registration, reap_loop};
use crate::metadata::MetadataClient;

/// The agent's side of GPU data.
#[derive(Debug)]
pub struct Tensors {
    id: String,
    url: String,
    /// The pod's address: where tensor listeners bind.
    ip: Option<String>,
    /// The pod's node (reported in quorum joins), checked at the start.
    node: Option<String>,
    metadata: Arc<MetadataClient>,
    /// Calls to other agents (point-to-point sessions). It holds no
    /// token: a session shows the source the capabilities the metadata
    /// server minted for its keys, never this agent's bearer token (the
    /// source is a peer, and its URL is whatever its holder registered).
    peers: reqwest::Client,
    host: Arc<HostBackend>,
    cuda: std::sync::OnceLock<Result<Arc<dyn Backend>, String>>,
    regs: Mutex<HashMap<Key, Registration>>,
    /// Versions of registrations whose broadcast put is still running: a
    /// broadcast put of the same key by the same process meanwhile (another
    /// member of it) is one more putter, not a replacement.
    broadcasting: Mutex<HashSet<String>>,
    /// Broadcast puts waiting for their quorum, by owner and key: a
    /// `WithdrawPut` of the same process cancels their wait.
    waiting: Mutex<Vec<registrations::Waiting>>,
    /// Registrations of the last run whose owners did not survive it: the
    /// next reap unregisters them at the metadata server (that version).
    stale: Mutex<Vec<(Key, String)>>,
    /// CUDA destinations of gets: of each get while it runs, released when
    /// it ends; of `keep_mapped` gets, by owner (IPC handles stay open
    /// between gets into the same memory), released once the owner goes
    /// away. Locked after `regs` where both are.
    dests: Mutex<Vec<(registrations::Lender, MemHandle)>>,
    /// Numbers gets for `dests`.
    next_get: std::sync::atomic::AtomicU64,
    conns: Mutex<HashSet<u64>>,
    state_file: PathBuf,
    /// Bounds connecting and every collective of a transfer.
    timeout: Duration,
    wake: Notify,
    /// NCCL communicators kept between a group's rounds and between the
    /// sessions of a pair of agents (shared with the sessions' tasks).
    comms: Arc<comms::Comms>,
}

/// Settings of the tensor service.
#[derive(Debug, Clone)]
pub struct TensorConfig {
    pub shm_dir: PathBuf,
    /// Host-backend listener ports tried first.
    pub ports: Vec<u16>,
    pub state_dir: PathBuf,
    pub timeout: Duration,
    /// The pod's node, reported in quorum joins ([`QuorumJoin::node`]).
    ///
    /// [`QuorumJoin::node`]: kt_types::tensor::QuorumJoin::node
    pub node: Option<String>,
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(e.to_string())
}

fn transport(e: TransportError) -> ApiError {
    let code = match e {
        TransportError::Invalid(_) => ErrorCode::InvalidRequest,
        TransportError::Unsupported(_) | TransportError::Timeout(_) | TransportError::Peer(_) => {
            ErrorCode::Unavailable
        }
        TransportError::Io { .. } => ErrorCode::Unavailable,
    };
    ApiError::new(code, e.to_string())
}

/// A mutex's guard, poisoned or not (a panicked holder left the data
/// consistent: every critical section here is a plain insert or remove).
fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Transfer work off the async threads ([`kt_sync::task::blocking`],
/// typed for the agent's answers).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    kt_sync::task::blocking(f).await
}

impl Tensors {
    /// The metadata server's client (who owns a key, for the session route).
    pub(crate) fn metadata(&self) -> &MetadataClient {
        &self.metadata
    }

    pub fn new(
        id: String,
        url: String,
        ip: Option<String>,
        metadata: Arc<MetadataClient>,
        cfg: TensorConfig,
    ) -> Result<Self, String> {
        let http = kt_api::tls::http_builder()
            .map_err(|e| e.to_string())?
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| e.to_string())?;
        let state_file = cfg.state_dir.join("tensors.json");
        let tensors = Tensors {
            id,
            url,
            ip,
            node: cfg.node,
            metadata,
            peers: http,
            host: Arc::new(HostBackend::new(cfg.shm_dir).with_ports(cfg.ports)),
            cuda: std::sync::OnceLock::new(),
            regs: Mutex::default(),
            broadcasting: Mutex::default(),
            waiting: Mutex::default(),
            stale: Mutex::default(),
            dests: Mutex::default(),
            next_get: Default::default(),
            conns: Mutex::default(),
            state_file,
            timeout: cfg.timeout,
            wake: Notify::new(),
            comms: Arc::new(comms::Comms::new(comms::DEFAULT_LIMIT)),
        };
        tensors.load();
        Ok(tensors)
    }

    fn backend(&self, device: Device) -> Result<Arc<dyn Backend>, ApiError> {
        match device {
            Device::Cpu => Ok(self.host.clone()),
            Device::Cuda(_) => self
                .cuda
                .get_or_init(cuda_backend)
                .clone()
                .map_err(|m| ApiError::new(ErrorCode::Unavailable, m)),
        }
    }

    fn ip(&self) -> Result<String, ApiError> {
        self.ip.clone().ok_or_else(|| {
            ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "agent {} has no IP to move tensors from (its URL {} names no address; set KT_POD_IP)",
                    self.id, self.url
                ),
            )
        })
    }

    /// Retires communicators the kept set let go (or a transfer did not
    /// use) through `backend`, on a blocking thread (see `comms`).
    fn retire(backend: &Arc<dyn Backend>, gone: Vec<(Device, Box<dyn kt_tensor::Comm>)>) {
        if gone.is_empty() {
            return;
        }
        let b = backend.clone();
        kt_sync::task::spawn(move || {
            for (device, comm) in gone {
                b.retire(device, comm);
            }
        });
    }

    /// Maps every entry (checks that the handles open) into a set of regions.
    async fn map(
        backend: Arc<dyn Backend>,
        entries: Vec<TensorEntry>,
    ) -> Result<Vec<Box<dyn kt_tensor::Region>>, ApiError> {
        blocking(move || {
            entries
                .iter()
                .map(|e| {
                    backend.map(&e.mem, e.device).map_err(|err| {
                        transport(match err {
                            TransportError::Invalid(m) => {
                                TransportError::Invalid(format!("tensor {:?}: {m}", e.name))
                            }
                            other => other,
                        })
                    })
                })
                .collect()
        })
        .await
    }
}

#[cfg(feature = "cuda")]
fn cuda_backend() -> Result<Arc<dyn Backend>, String> {
    kt_tensor::cuda::CudaBackend::new()
        .map(|b| Arc::new(b) as Arc<dyn Backend>)
        .map_err(|e| format!("this agent cannot move CUDA tensors: {e}"))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend() -> Result<Arc<dyn Backend>, String> {
    Err("this agent was built without CUDA support (feature `cuda`)".into())
}
