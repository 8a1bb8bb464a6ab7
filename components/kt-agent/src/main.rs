use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use kt_types::env;

/// kt node agent: serves this pod's locale=local data and downloaded copies
/// read-only to peers, moves its GPU data (tensors lent by its processes), heartbeats to the metadata server, and takes requests
/// from `kt` on a local control socket.
#[derive(Debug, Parser)]
#[command(name = "kt-agent", version)]
struct Args {
    /// Address to serve peers on.
    #[arg(long, env = env::AGENT_LISTEN, default_value = "0.0.0.0:8090")]
    listen: SocketAddr,
    /// URL under which peers reach this agent (default: http://$KT_POD_IP:PORT
    /// when listening on 0.0.0.0, else the listen address).
    #[arg(long, env = env::AGENT_URL)]
    advertise_url: Option<String>,
    /// This pod's IP, advertised when listening on an unspecified address.
    #[arg(long, env = env::POD_IP)]
    pod_ip: Option<String>,
    /// Agent id, unique per pod (default: $KT_POD_NAME, else the host name).
    #[arg(long, env = env::AGENT_ID)]
    id: Option<String>,
    /// Service this pod belongs to (announced to the metadata server).
    #[arg(long, env = env::SERVICE)]
    service: Option<String>,
    #[command(flatten)]
    metadata: kt_service::cli::MetadataArgs,
    /// Control socket (default: $XDG_RUNTIME_DIR/kt/agent.sock, else /tmp/kt-<uid>/agent.sock).
    #[arg(long, env = env::AGENT_SOCKET)]
    socket: Option<PathBuf>,
    /// Give the control socket (0660) and its directory (0750) to this gid,
    /// e.g. the pod's fsGroup: workloads of another uid in that group reach
    /// the agent (default: the agent's user alone, socket 0600).
    #[arg(long, env = env::AGENT_SOCKET_GROUP)]
    socket_group: Option<u32>,
    /// Where exports are persisted (default: beside the socket, <socket>.state).
    #[arg(long, env = env::AGENT_STATE_DIR)]
    state_dir: Option<PathBuf>,
    /// Directories whose files the pod's workloads may put with
    /// --locale local and serve as copies (comma-separated; default:
    /// anywhere but /etc, /proc, /sys, /dev, /boot, the secrets mounts and
    /// the agent's own state).
    #[arg(long = "export-root", env = env::EXPORT_ROOTS, value_delimiter = ',')]
    export_roots: Vec<PathBuf>,
    #[command(flatten)]
    server: kt_service::cli::ServerArgs,
    /// Shared-memory directory of host-backend tensors (the applications of
    /// the pod must see the same one).
    #[arg(long, env = env::SHM_DIR)]
    shm_dir: Option<PathBuf>,
    /// Bounds connecting the ranks of a tensor transfer and each collective, e.g. 60s.
    #[arg(long, env = env::TENSOR_TIMEOUT, default_value = "60s", value_parser = humantime::parse_duration)]
    tensor_timeout: std::time::Duration,
    /// Ports host-backend tensor listeners try first (a port or a range;
    /// 0: any), the ports the bundle's NetworkPolicy opens.
    #[arg(long, env = env::TENSOR_PORT, default_value = kt_types::env::DEFAULT_TENSOR_PORTS)]
    tensor_port: String,
    /// End once no control client, local put or tensor has needed the
    /// agent for this long, e.g. 30s (`kt` starts agents on demand so);
    /// absent: run until stopped.
    #[arg(long, env = env::AGENT_EXIT_WHEN_IDLE, value_parser = humantime::parse_duration)]
    exit_when_idle: Option<std::time::Duration>,
    /// Range size for large files, in bytes (a power of two).
    #[arg(long, env = env::CHUNK_SIZE, default_value_t = kt_sync::defaults::CHUNK_SIZE)]
    chunk_size: u64,
    /// Node-cache mode (a DaemonSet's agent): hold datasets for this node
    /// below --dataset-root and serve the dataset API (admin callers only)
    /// to the Dataset controller.
    #[arg(long, env = env::NODE_CACHE, value_parser = clap::builder::BoolishValueParser::new())]
    node_cache: bool,
    /// The node the pod runs on (the pod's spec.nodeName): the node this
    /// agent holds data for (node-cache mode), and what its quorum joins
    /// report, so members of one node are planned together.
    #[arg(long, env = env::NODE_NAME)]
    node_name: Option<String>,
    /// Where datasets are kept (node-cache mode; a hostPath).
    #[arg(long, env = env::DATASET_ROOT, default_value = kt_types::dataset::DEFAULT_ROOT)]
    dataset_root: PathBuf,
    /// The most bytes kept below --dataset-root, e.g. 100GiB (node-cache
    /// mode; default: the filesystem's size).
    #[arg(long, env = env::DATASET_BUDGET, value_parser = kt_client::size::parse)]
    dataset_budget: Option<u64>,
    /// Answer Arrow Flight DoGet here, e.g. 0.0.0.0:8815: a ticket
    /// {"prefix":..,"rank":..,"world":..} streams that rank's share of the
    /// Parquet / Arrow IPC files below the prefix as record batches, read
    /// with the caller's token (needs the `flight` cargo feature; absent: off).
    #[arg(long, env = env::FLIGHT_ADDR)]
    flight_addr: Option<SocketAddr>,
    /// Local bytes one Flight DoGet may hold (files fetched ahead), e.g. 1GiB.
    #[arg(long, env = env::FLIGHT_BUDGET, value_parser = kt_client::size::parse)]
    flight_budget: Option<u64>,
    /// Flight DoGet calls served at once; more get ResourceExhausted (the
    /// disk they may hold is this times --flight-budget).
    #[arg(long, env = env::FLIGHT_MAX_CALLS, value_parser = clap::value_parser!(u16).range(1..))]
    flight_max_calls: Option<u16>,
    /// How long a Flight call may wait for its first file or for its
    /// client to take a batch, e.g. 60s; past it the call ends.
    #[arg(long, env = env::FLIGHT_IDLE, value_parser = humantime::parse_duration)]
    flight_idle: Option<std::time::Duration>,
    /// Where Flight calls fetch their files (default: `flight` below the
    /// state directory); its free space must hold --flight-budget times
    /// --flight-max-calls, or the agent does not start.
    #[arg(long, env = env::FLIGHT_DIR)]
    flight_dir: Option<PathBuf>,
    /// Flight calls one token may hold at once (default 4); more get
    /// ResourceExhausted.
    #[arg(long, env = env::FLIGHT_MAX_CALLS_PER_TOKEN, value_parser = clap::value_parser!(u16).range(1..))]
    flight_max_calls_per_token: Option<u16>,
    /// The most files a Flight share's prefix may hold (default 1000000);
    /// a larger listing is refused.
    #[arg(long, env = env::FLIGHT_MAX_FILES, value_parser = clap::value_parser!(u32).range(1..))]
    flight_max_files: Option<u32>,
    /// The longest one Flight call may last, e.g. 6h (the default).
    #[arg(long, env = env::FLIGHT_MAX_DURATION, value_parser = humantime::parse_duration)]
    flight_max_duration: Option<std::time::Duration>,
}

fn main() -> anyhow::Result<()> {
    // NCCL reads its settings from the environment (the pod's interface,
    // the allow-listed NCCL_* settings): set while no other thread exists.
    #[cfg(feature = "cuda")]
    #[allow(unsafe_code)]
    // SAFETY: the runtime (and every other thread) starts below.
    let nccl_notes = unsafe {
        kt_tensor::cuda::netenv::prepare_nccl_env(
            std::env::var(kt_types::env::POD_IP).ok().as_deref(),
        )
    };
    #[cfg(not(feature = "cuda"))]
    let nccl_notes = Vec::new();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(agent(nccl_notes))
}

async fn agent(nccl_notes: Vec<String>) -> anyhow::Result<()> {
    // Started again by its own NCCL backend for a unique id (see
    // kt_tensor::cuda::serve_root_helper): that, and nothing else.
    #[cfg(feature = "cuda")]
    if let Some(served) = kt_tensor::cuda::serve_root_helper() {
        return served.map_err(anyhow::Error::msg);
    }
    let args = Args::parse();
    let server = args.server.load(Some(&args.metadata.metadata_url))?;
    for note in nccl_notes {
        tracing::info!("{note}");
    }
    let node_cache = if args.node_cache {
        let node = args
            .node_name
            .clone()
            .filter(|n| !n.trim().is_empty())
            .ok_or_else(|| {
                anyhow::anyhow!("--node-cache needs the node's name (--node-name, KT_NODE_NAME)")
            })?;
        let mut nc = kt_agent::datasets::NodeCacheConfig::new(node.trim());
        nc.root = args.dataset_root.clone();
        nc.budget = args.dataset_budget;
        nc.token_file = args.server.token.token_file.clone();
        Some(nc)
    } else {
        None
    };
    let (listener, shutdown) = kt_service::cli::bind_with_shutdown(args.listen).await?;
    let socket = args.socket.unwrap_or_else(kt_agent::config::default_socket);
    let id = args.id.unwrap_or_else(kt_agent::config::default_id);
    let mut config = kt_agent::Config::new(id, args.metadata.metadata_url, server, socket);
    if let Some(dir) = args.state_dir {
        config.state_dir = dir;
    } else if let Some(nc) = &node_cache {
        // On the hostPath: its exports survive a restart with the data.
        config.state_dir = nc.state_dir();
    }
    config.node_cache = node_cache;
    config.export_roots = args.export_roots;
    config.socket_group = args.socket_group;
    config.advertise_url = args.advertise_url;
    config.pod_ip = args.pod_ip;
    config
        .check_node(args.node_name.as_deref())
        .map_err(anyhow::Error::msg)?;
    // The sidecar takes it from the pod's label: an unlabelled pod gives "".
    config.service = args.service.filter(|s| !s.is_empty());
    config.chunk_size = args.chunk_size;
    if let Some(dir) = args.shm_dir {
        config.shm_dir = dir;
    }
    config.tensor_timeout = args.tensor_timeout;
    config.tensor_ports = kt_types::env::ports(
        kt_types::env::TENSOR_PORT,
        &args.tensor_port,
        kt_types::env::DEFAULT_TENSOR_PORTS,
    )
    .map_err(anyhow::Error::msg)?;
    config.exit_when_idle = args.exit_when_idle;
    config.flight = args.flight_addr.map(|addr| {
        let mut f = kt_agent::config::FlightConfig::new(addr);
        if let Some(b) = args.flight_budget {
            f.budget = b;
        }
        if let Some(n) = args.flight_max_calls {
            f.max_calls = usize::from(n);
        }
        if let Some(idle) = args.flight_idle {
            f.idle = idle;
        }
        f.dir = args.flight_dir;
        if let Some(n) = args.flight_max_calls_per_token {
            f.per_token = usize::from(n);
        }
        if let Some(n) = args.flight_max_files {
            f.max_files = n as usize;
        }
        if let Some(d) = args.flight_max_duration {
            f.max_duration = d;
        }
        f
    });
    kt_agent::run(listener, config, shutdown).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn boolean_env_flags_take_1_0_yes_no_on_off() {
        kt_service::cli::assert_boolish_env_flags::<super::Args>();
    }
}
