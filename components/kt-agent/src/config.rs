//! Configuration of an agent, and the defaults its flags fall back to.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use kt_service::cli::ServerConfig;
use kt_types::manifest::ManifestLimits;

/// Everything an agent needs besides its listener.
#[derive(Debug, Clone)]
pub struct Config {
    /// Unique per pod (the pod's name): the agent's id at the metadata server.
    pub id: String,
    /// URL under which peers reach this agent; see [`advertised`].
    pub advertise_url: Option<String>,
    /// The pod's IP (`KT_POD_IP`): advertised when listening on an unspecified address.
    pub pod_ip: Option<String>,
    /// The node the pod runs on (`KT_NODE_NAME`, the downward API's
    /// `spec.nodeName`): reported in quorum joins, so the plan groups the
    /// members of one node (see `kt_types::tensor::TransferPlan::nodes`).
    /// Checked by [`Config::check_node`].
    pub node: Option<String>,
    /// The owning service, announced with every heartbeat.
    pub service: Option<String>,
    pub metadata_url: String,
    /// What every server takes from the shared flags
    /// ([`kt_service::cli::ServerArgs::load`]): its token, who may call it,
    /// TLS, requests served at once.
    pub server: ServerConfig,
    /// The control socket (created mode 0600; a stale one is replaced).
    pub socket: PathBuf,
    /// Give the socket (0660) and its directory (0750) to this group: the
    /// workloads of the pod reach the agent as members of it, whatever
    /// their uid ([`crate::control::bind`]). `None`: the agent's user alone.
    pub socket_group: Option<u32>,
    /// Where exports are persisted (and scan caches of local exports kept).
    pub state_dir: PathBuf,
    /// Exports must lie below one of these (`--export-root`); empty:
    /// anywhere but the system's places and the agent's own
    /// ([`crate::exportable`]).
    pub export_roots: Vec<PathBuf>,
    /// Large files are fetched from this agent in ranges of this size.
    pub chunk_size: u64,
    /// Largest JSON request (batch requests list indices).
    pub max_request_bytes: usize,
    pub limits: ManifestLimits,
    /// Idle read leases are released after this.
    pub lease_ttl: Duration,
    /// Heartbeat period until the metadata server names its own.
    pub heartbeat: Duration,
    /// Timeout of each request to the metadata server.
    pub metadata_timeout: Duration,
    /// How long in-flight requests may finish after shutdown is requested.
    pub drain: Duration,
    /// Shared-memory directory of host-backend tensors (`KT_SHM_DIR`).
    pub shm_dir: PathBuf,
    /// Bounds connecting the ranks of a tensor transfer and each collective.
    pub tensor_timeout: Duration,
    /// Ports host-backend tensor listeners try first (`KT_TENSOR_PORT`);
    /// empty: any free port.
    pub tensor_ports: Vec<u16>,
    /// End the agent once it has had no control client, local put or
    /// tensor for this long (`--exit-when-idle`; an agent `kt` starts on
    /// demand). `None`: it runs until stopped.
    pub exit_when_idle: Option<Duration>,
    /// Node-cache mode (`--node-cache`): hold datasets for the node and
    /// serve the dataset API ([`crate::datasets`]). `None`: a pod's agent.
    pub node_cache: Option<crate::datasets::NodeCacheConfig>,
    /// Arrow Flight (`--flight-addr`; the `flight` cargo feature): DoGet of
    /// a rank's share. `None`: no Flight server.
    pub flight: Option<FlightConfig>,
}

/// The Arrow Flight server of an agent ([`crate::flight`]).
#[derive(Debug, Clone)]
pub struct FlightConfig {
    /// Where it listens (`--flight-addr`, `KT_FLIGHT_ADDR`).
    pub addr: SocketAddr,
    /// Local bytes one DoGet may hold: the files fetched ahead of the one
    /// being decoded (`--flight-budget`).
    pub budget: u64,
    /// DoGet calls served at once; more are refused (`ResourceExhausted`).
    pub max_calls: usize,
    /// How long a call may wait: for its listing and first file (the
    /// server's request timeout), and for the client to take each batch;
    /// past it the call ends and its slot is free again.
    pub idle: Duration,
    /// Where calls fetch their files (`--flight-dir`); `None`: `flight`
    /// below the state directory. Its free space must hold `budget` times
    /// `max_calls` at start.
    pub dir: Option<PathBuf>,
    /// Calls one token may hold at once (`--flight-max-calls-per-token`).
    pub per_token: usize,
    /// The most files a share's listing may hold (`--flight-max-files`).
    pub max_files: usize,
    /// The longest one call may last, however fast it reads
    /// (`--flight-max-duration`).
    pub max_duration: Duration,
}

impl FlightConfig {
    /// On `addr`, 1 GiB per call, 16 calls at once (4 per token), a
    /// million files per share, 6 hours per call.
    pub fn new(addr: SocketAddr) -> Self {
        FlightConfig {
            addr,
            budget: DEFAULT_FLIGHT_BUDGET,
            max_calls: 16,
            idle: DEFAULT_FLIGHT_IDLE,
            dir: None,
            per_token: 4,
            max_files: 1_000_000,
            max_duration: Duration::from_secs(6 * 3600),
        }
    }
}

/// Default of [`FlightConfig::idle`].
pub const DEFAULT_FLIGHT_IDLE: Duration = Duration::from_secs(60);

/// Default of [`FlightConfig::budget`].
pub const DEFAULT_FLIGHT_BUDGET: u64 = 1 << 30;

impl Config {
    pub fn new(
        id: impl Into<String>,
        metadata_url: impl Into<String>,
        server: impl Into<ServerConfig>,
        socket: impl Into<PathBuf>,
    ) -> Self {
        let socket = socket.into();
        Config {
            id: id.into(),
            advertise_url: None,
            pod_ip: None,
            node: None,
            service: None,
            metadata_url: metadata_url.into(),
            server: server.into(),
            state_dir: default_state_dir(&socket),
            export_roots: Vec::new(),
            socket_group: None,
            socket,
            chunk_size: kt_sync::defaults::CHUNK_SIZE,
            max_request_bytes: 64 << 20,
            limits: ManifestLimits::default(),
            lease_ttl: Duration::from_secs(300),
            heartbeat: Duration::from_secs(2),
            metadata_timeout: Duration::from_secs(10),
            drain: Duration::from_secs(10),
            shm_dir: kt_tensor::shm::shm_dir(),
            tensor_timeout: Duration::from_secs(60),
            tensor_ports: Vec::new(),
            exit_when_idle: None,
            node_cache: None,
            flight: None,
        }
    }
}

impl Config {
    /// Sets [`Config::node`] from `KT_NODE_NAME`'s value: trimmed, empty
    /// as unset; a name Kubernetes could not give a node is an error
    /// naming what is valid.
    pub fn check_node(&mut self, node: Option<&str>) -> Result<(), String> {
        self.node = match node.map(str::trim).filter(|n| !n.is_empty()) {
            None => None,
            Some(n) => match kt_types::tensor::node_name_problem(n) {
                None => Some(n.to_owned()),
                Some(why) => {
                    return Err(format!(
                        "the pod's node (--node-name, {}): {why}",
                        kt_types::env::NODE_NAME
                    ));
                }
            },
        };
        Ok(())
    }
}

/// `$XDG_RUNTIME_DIR/kt/agent.sock`, else `/tmp/kt-<uid>/agent.sock`
/// (`KT_AGENT_SOCKET` overrides it, through the flag).
pub fn default_socket() -> PathBuf {
    kt_service::cli::default_agent_socket()
}

/// Beside the socket: `agent.sock` → `agent.state/`.
pub fn default_state_dir(socket: &Path) -> PathBuf {
    socket.with_extension("state")
}

/// `KT_POD_NAME`, else the host name, else `kt-agent`.
pub fn default_id() -> String {
    let from_env = std::env::var(kt_types::env::POD_NAME).ok();
    let from_host = || {
        ["/proc/sys/kernel/hostname", "/etc/hostname"]
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok())
    };
    from_env
        .or_else(from_host)
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "kt-agent".to_owned())
}

/// The URL peers use: the configured one; else, listening on an unspecified
/// address, the pod IP (or 127.0.0.1, with a warning); else the listen
/// address (`https` when serving TLS).
pub fn advertised(
    addr: SocketAddr,
    configured: Option<&str>,
    pod_ip: Option<&str>,
    https: bool,
) -> String {
    if let Some(u) = configured.filter(|u| !u.is_empty()) {
        return u.trim_end_matches('/').to_owned();
    }
    let ip = if addr.ip().is_unspecified() {
        match pod_ip.and_then(|p| p.trim().parse::<IpAddr>().ok()) {
            Some(ip) => ip,
            None => {
                tracing::warn!(
                    "listening on an unspecified address without KT_POD_IP; advertising 127.0.0.1 (set --advertise-url)"
                );
                IpAddr::from([127, 0, 0, 1])
            }
        }
    } else {
        addr.ip()
    };
    let scheme = if https { "https" } else { "http" };
    format!("{scheme}://{}", SocketAddr::new(ip, addr.port()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `KT_NODE_NAME` as the downward API gives it is kept (trimmed);
    /// empty is unset; anything Kubernetes could not name a node stops
    /// the agent, saying what is valid.
    #[test]
    fn the_pods_node_is_a_kubernetes_node_name() {
        let token = kt_service::Token::new("t").unwrap();
        let mut c = Config::new("a", "http://m", token, "/tmp/s");
        c.check_node(Some(" gpu-node-3 ")).unwrap();
        assert_eq!(c.node.as_deref(), Some("gpu-node-3"));
        c.check_node(Some("  ")).unwrap();
        assert_eq!(c.node, None);
        let e = c.check_node(Some("GPU_node")).unwrap_err();
        assert!(
            e.contains(kt_types::env::NODE_NAME) && e.contains("lowercase"),
            "{e}"
        );
    }

    #[test]
    fn advertised_urls() {
        let any: SocketAddr = "0.0.0.0:8090".parse().unwrap();
        let lo: SocketAddr = "127.0.0.3:9000".parse().unwrap();
        assert_eq!(advertised(any, None, None, false), "http://127.0.0.1:8090");
        assert_eq!(
            advertised(any, None, Some("10.1.2.3"), false),
            "http://10.1.2.3:8090"
        );
        assert_eq!(
            advertised(any, None, Some("fd00::5"), true),
            "https://[fd00::5]:8090"
        );
        assert_eq!(
            advertised(lo, None, Some("10.1.2.3"), false),
            "http://127.0.0.3:9000"
        );
        assert_eq!(
            advertised(any, Some("http://agent.svc:1/"), Some("10.1.2.3"), true),
            "http://agent.svc:1"
        );
    }

    #[test]
    fn state_dir_sits_beside_the_socket() {
        assert_eq!(
            default_state_dir(Path::new("/run/user/1/kt/agent.sock")),
            PathBuf::from("/run/user/1/kt/agent.state")
        );
        assert_eq!(
            default_state_dir(Path::new("/tmp/kt-agent-1.sock")),
            PathBuf::from("/tmp/kt-agent-1.state")
        );
        assert!(!default_id().is_empty());
        let s = default_socket();
        assert!(s.to_string_lossy().ends_with(".sock"), "{}", s.display());
    }
}
