//! Environment variable names, in one place. Every CLI flag has one of these.

/// Base URL of the metadata server: where `kt` (default
/// `http://127.0.0.1:8081`), the store and the node agents reach it.
pub const METADATA_URL: &str = "KT_METADATA_URL";
/// The bearer token: sent by every client, required by every server (prefer
/// [`TOKEN_FILE`]).
pub const TOKEN: &str = "KT_TOKEN";
/// A file holding the bearer token.
pub const TOKEN_FILE: &str = "KT_TOKEN_FILE";
/// The Kubernetes namespace kt is installed in (`kt --kube`; default: the
/// context's), or the one the metadata server watches (default: its pod's
/// service-account namespace).
pub const NAMESPACE: &str = "KT_NAMESPACE";
/// Address the metadata server (default `0.0.0.0:8081`) or the store
/// (default `0.0.0.0:8082`) listens on.
pub const LISTEN: &str = "KT_LISTEN";
/// Directory of the metadata server's registry database.
pub const STATE_DIR: &str = "KT_STATE_DIR";
/// Directory of the store's data (a persistent volume in a cluster).
pub const DATA_DIR: &str = "KT_DATA_DIR";
/// URL under which clients reach the store (default: its listen address);
/// it is what the store registers with the metadata server.
pub const ADVERTISE_URL: &str = "KT_ADVERTISE_URL";
/// Log filter, in tracing's `EnvFilter` syntax (servers default to `info`,
/// `kt` to `warn`).
pub const LOG: &str = "KT_LOG";
/// A server's log format: `json`, `text` or `auto` (the default: JSON unless
/// stderr is a terminal).
pub const LOG_FORMAT: &str = "KT_LOG_FORMAT";
/// Requests a server serves at once (default 512); more wait.
pub const MAX_CONNECTIONS: &str = "KT_MAX_CONNECTIONS";
/// The store's and a node agent's chunk size in bytes, a power of two
/// (default 8 MiB): files larger than this move in ranges of this size.
pub const CHUNK_SIZE: &str = "KT_CHUNK_SIZE";
/// Parallel streams of one `kt` transfer (default 4).
pub const STREAMS: &str = "KT_STREAMS";
/// `kt`'s progress bars: `auto` (on a terminal; the default), `always` or
/// `never`.
pub const PROGRESS: &str = "KT_PROGRESS";
/// The pod's own IP (set by the pod spec, or the testbed): agents advertise
/// it, and broadcast relays listen on it.
pub const POD_IP: &str = "KT_POD_IP";
/// The port (or range, `8091-8099`) broadcast relays listen on.
pub const RELAY_PORT: &str = "KT_RELAY_PORT";
/// Shared-memory directory of host-backend tensors (default `/dev/shm`); the
/// agent and the applications of a pod must see the same one.
pub const SHM_DIR: &str = "KT_SHM_DIR";
/// CUDA device the NCCL backend of an agent uses (default 0).
pub const CUDA_DEVICE: &str = "KT_CUDA_DEVICE";
/// Bounds connecting the ranks of a tensor transfer and each collective.
pub const TENSOR_TIMEOUT: &str = "KT_TENSOR_TIMEOUT";
/// Ports the host backend's tensor listeners try (a port or a range).
pub const TENSOR_PORT: &str = "KT_TENSOR_PORT";
/// A boolean ([`boolish`]), default on; off (`0`, `false`, `no`, `off`):
/// `kt` never starts a node agent on demand (the pod's agent is run
/// for it, as a sidecar or by a testbed); it waits a while for that agent
/// to come back instead. An agent `kt` starts presents `kt`'s own token,
/// which under least privilege is a workload's and may not act as an agent.
pub const AGENT_AUTOSTART: &str = "KT_AGENT_AUTOSTART";
/// Where a node agent answers Arrow Flight `DoGet` for a rank's share of a
/// dataset (`--flight-addr`, e.g. `0.0.0.0:8815`; unset: no Flight server).
pub const FLIGHT_ADDR: &str = "KT_FLIGHT_ADDR";
/// Local bytes one Flight `DoGet` of a node agent may hold, e.g. `1GiB`.
pub const FLIGHT_BUDGET: &str = "KT_FLIGHT_BUDGET";
/// Flight `DoGet` calls a node agent serves at once; more are refused.
pub const FLIGHT_MAX_CALLS: &str = "KT_FLIGHT_MAX_CALLS";
/// How long a Flight `DoGet` may wait for its first file or for its client
/// to take a batch before the call ends and its slot is free, e.g. `60s`.
pub const FLIGHT_IDLE: &str = "KT_FLIGHT_IDLE";
/// The tensor listener ports tried by default (the bundle's NetworkPolicy opens them).
pub const DEFAULT_TENSOR_PORTS: &str = "8100-8163";

/// A boolean variable's value, in the forms the DESIGN's boolean contract
/// allows (any case, surrounding blanks ignored): `1`/`true`/`yes`/`on`, or
/// `0`/`false`/`no`/`off`. Anything else is an error naming `var`, for the
/// caller to report (and fall back on its default).
pub fn boolish(var: &str, value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!(
            "{var}={value:?}: not a boolean (1/0, true/false, yes/no, on/off)"
        )),
    }
}

/// The ports a port variable (`var`, e.g. [`RELAY_PORT`]) names: `8091`,
/// `8091-8099`, or `0` (any: nothing to try before the system's choice);
/// empty: `default`.
pub fn ports(var: &str, spec: &str, default: &str) -> Result<Vec<u16>, String> {
    let spec = spec.trim();
    let spec = if spec.is_empty() { default } else { spec };
    let bad = || format!("{var}={spec:?}: a port or a range such as 8091-8099");
    let (lo, hi) = match spec.split_once('-') {
        Some((a, b)) => (a.trim().parse::<u16>(), b.trim().parse::<u16>()),
        None => (spec.parse::<u16>(), spec.parse::<u16>()),
    };
    let (lo, hi) = (lo.map_err(|_| bad())?, hi.map_err(|_| bad())?);
    if lo > hi {
        return Err(bad());
    }
    Ok((lo..=hi).filter(|p| *p != 0).collect())
}

/// OpenTelemetry's standard variable for the collector's base URL
/// (`/v1/traces` is added): the servers export traces over OTLP when it is
/// set (`kt_service::telemetry`).
pub const OTEL_EXPORTER_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// The OTLP traces URL whole (instead of the base URL above).
pub const OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
/// The service name exported spans carry (default: the program's name).
pub const OTEL_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
/// `true`: no OTLP export whatever the endpoint.
pub const OTEL_SDK_DISABLED: &str = "OTEL_SDK_DISABLED";
