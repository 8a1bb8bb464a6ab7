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

// What `kt` and the Python client read (the `kt` CLI's flags and
// `kt.Client`'s defaults; servers that call other servers read some too).

/// Path of a PEM file of CAs that every kt client (`kt`, the servers'
/// calls, the agents) trusts for `https://` URLs instead of the system's.
pub const CA_FILE: &str = "KT_CA_FILE";
/// How long a `kt` call may go on failing to reach the metadata server
/// before it first answers (default `4s`).
pub const CONNECT_TIMEOUT: &str = "KT_CONNECT_TIMEOUT";
/// How long a `kt` transfer keeps trying while its sources fail
/// transiently, counted from its last progress (default `5m`).
pub const DEADLINE: &str = "KT_DEADLINE";
/// How long a source may send nothing before `kt` counts it as stalled and
/// tries another (default `20s`).
pub const STALL_TIMEOUT: &str = "KT_STALL_TIMEOUT";
/// A boolean ([`boolish`]), default off: `kt` reaches the cluster from
/// outside, through the Kubernetes API's port-forwarding.
pub const KUBE: &str = "KT_KUBE";
/// With [`KUBE`]: the kubeconfig context to use (default: its current one).
pub const KUBE_CONTEXT: &str = "KT_KUBE_CONTEXT";

// The node agent: read by `kt-agent`, set by whoever starts one (`kt` on
// demand, the sidecar injector, the testbeds).

/// The agent's control socket: where `kt-agent` listens and `kt` connects
/// (default: `$XDG_RUNTIME_DIR/kt/agent.sock`, else
/// `/tmp/kt-<uid>/agent.sock`).
pub const AGENT_SOCKET: &str = "KT_AGENT_SOCKET";
/// The address a node agent serves its peers on (default `0.0.0.0:8090`;
/// one `kt` starts on demand: the pod's IP, else loopback).
pub const AGENT_LISTEN: &str = "KT_AGENT_LISTEN";
/// A node agent's id, unique per pod (default: [`POD_NAME`], else the
/// host name).
pub const AGENT_ID: &str = "KT_AGENT_ID";
/// How long a node agent may go unneeded before it ends, e.g. `30s`
/// (unset: it runs until stopped; `kt` sets it on the agents it starts).
pub const AGENT_EXIT_WHEN_IDLE: &str = "KT_AGENT_EXIT_WHEN_IDLE";
/// A boolean ([`boolish`]), default off: an agent `kt` starts on demand
/// runs until stopped instead of ending when idle.
pub const AGENT_STAY: &str = "KT_AGENT_STAY";
/// The `kt-agent` executable `kt` starts on demand (default: beside `kt`,
/// else on `PATH`).
pub const AGENT_BIN: &str = "KT_AGENT_BIN";
/// The pod's name (the downward API's `metadata.name`): an agent's
/// default id.
pub const POD_NAME: &str = "KT_POD_NAME";
/// The node a pod runs on (the downward API's `spec.nodeName`): a
/// node-cache agent's node, and NCCL's host identity with
/// [`NCCL_SAME_NODE`].
pub const NODE_NAME: &str = "KT_NODE_NAME";
/// A boolean ([`boolish`]), default off: the agent runs in node-cache mode
/// (a DaemonSet's agent holding datasets for its node).
pub const NODE_CACHE: &str = "KT_NODE_CACHE";
/// Where a node-cache agent keeps datasets (a hostPath; default
/// `kt_types::dataset::DEFAULT_ROOT`).
pub const DATASET_ROOT: &str = "KT_DATASET_ROOT";
/// The most bytes a node-cache agent keeps below [`DATASET_ROOT`], e.g.
/// `500GiB` (default: the filesystem's size).
pub const DATASET_BUDGET: &str = "KT_DATASET_BUDGET";
/// Where a dataset consumer's first container finds its dataset (mounted
/// read-only; the `dataset-consumer` kustomize component sets it). Read by
/// the workload, not by kt.
pub const DATASET_DIR: &str = "KT_DATASET_DIR";
/// Path of the NCCL library an agent loads instead of searching
/// `libnccl.so.2` and `libnccl.so` (e.g. a Python wheel's
/// `site-packages/nvidia/nccl/lib/libnccl.so.2`).
pub const NCCL_LIBRARY: &str = "KT_NCCL_LIBRARY";
/// How the agent's NCCL treats pods that share a node: `p2p` or
/// `separate` (unset: NCCL's own view).
pub const NCCL_SAME_NODE: &str = "KT_NCCL_SAME_NODE";
/// Set (to its lifetime in milliseconds) in the helper process that makes
/// an NCCL root id (`kt_tensor::cuda::root`).
pub const NCCL_ROOT_HELPER: &str = "KT_NCCL_ROOT_HELPER";
/// Not read from the environment: what the NCCL root helper's answer on
/// stdout starts with when it has an id (its hex follows).
pub const NCCL_ROOT_ID_PREFIX: &str = "KT_NCCL_ROOT_ID=";
/// Not read from the environment: what the NCCL root helper's answer on
/// stdout starts with when it has no id (the reason follows).
pub const NCCL_ROOT_ERROR_PREFIX: &str = "KT_NCCL_ROOT_ERROR=";

// Server settings that other programs set too (the testbeds, the Dataset
// controller's ingest jobs); the servers' own flags are further down.

/// Serve HTTPS with this PEM certificate chain (with [`TLS_KEY`]): the
/// servers and the broadcast relays.
pub const TLS_CERT: &str = "KT_TLS_CERT";
/// The PEM private key of [`TLS_CERT`].
pub const TLS_KEY: &str = "KT_TLS_KEY";
/// A tokens file (JSON) granting roles (admin, store, agent, workload):
/// a server accepts only its tokens.
pub const AUTH_FILE: &str = "KT_AUTH_FILE";
/// How long the metadata server keeps a silent agent as a source (default
/// `10s`).
pub const AGENT_TTL: &str = "KT_AGENT_TTL";
/// How long a source lease lasts on the metadata server unless the getter
/// renews it (default `30s`).
pub const LEASE_TTL: &str = "KT_LEASE_TTL";

/// The prefix of every kt variable.
pub const PREFIX: &str = "KT_";

/// The variable of a server flag: `--lease-ttl` -> `KT_LEASE_TTL`.
pub fn of_flag(flag: &str) -> String {
    format!(
        "{PREFIX}{}",
        flag.trim_start_matches('-')
            .replace('-', "_")
            .to_ascii_uppercase()
    )
}

// Development and test tools: the testbeds, kt-scenario's targets, the
// benchmarks, the tests' child processes.

/// The kind or k3d cluster kt-scenario uses (and keeps), or the name it
/// creates (default `kt-scenario`).
pub const CLUSTER: &str = "KT_CLUSTER";
/// A boolean ([`boolish`]): kt-scenario keeps a cluster its run created
/// (`--keep-cluster`).
pub const KEEP_CLUSTER: &str = "KT_KEEP_CLUSTER";
/// The tag of the images kt-scenario's docker and cluster targets run
/// (default: the git revision, as `make images` tags).
pub const IMAGE_TAG: &str = "KT_IMAGE_TAG";
/// The repository of the images the docker target runs (default
/// `ghcr.io/kt-dev`).
pub const IMAGE_REPO: &str = "KT_IMAGE_REPO";
/// The kustomize bundle the cluster targets install (default: `kustomize`
/// in the repository).
pub const KUSTOMIZE_DIR: &str = "KT_KUSTOMIZE_DIR";
/// How long a cluster target's rollout may take, e.g. `300s` (default
/// `180s`).
pub const ROLLOUT_TIMEOUT: &str = "KT_ROLLOUT_TIMEOUT";
/// kt-scenario runs only scenarios with one of these tags
/// (comma-separated; `--tags`).
pub const SCENARIO_TAGS: &str = "KT_SCENARIO_TAGS";
/// The prefix of the variables the kubelet sets for the `kt-store`
/// Service (`KT_STORE_PORT`...: Kubernetes' service links). kt reads none
/// of them; the bundle target reproduces them.
pub const STORE_SERVICE_LINKS: &str = "KT_STORE_";
/// The `moto_server` executable the S3 ingest tests run (default:
/// `<target>/s3env/bin/moto_server`, else `PATH`'s).
pub const MOTO_SERVER: &str = "KT_MOTO_SERVER";
/// Set (to anything): the CRD test rewrites
/// `kustomize/components/datasets/crd.yaml` instead of failing on a
/// difference.
pub const UPDATE_CRD: &str = "KT_UPDATE_CRD";
/// `make fuzz`: the seed of the fuzz targets' choices (default: the
/// clock; printed, so a failure repeats).
pub const FUZZ_SEED: &str = "KT_FUZZ_SEED";
/// `make fuzz`: how long each fuzz target runs, in seconds (default 30).
pub const FUZZ_SECONDS: &str = "KT_FUZZ_SECONDS";
/// kt-bench-s3: the directory of its files (default: the system's
/// temporary directory).
pub const BENCH_DIR: &str = "KT_BENCH_DIR";
/// kt-bench-s3: the bytes of the data set, e.g. `1GiB`.
pub const BENCH_SIZE: &str = "KT_BENCH_SIZE";
/// kt-bench-s3: the number of objects (default 1000).
pub const BENCH_OBJECTS: &str = "KT_BENCH_OBJECTS";
/// kt-bench-s3: the runs of each case (default 3).
pub const BENCH_RUNS: &str = "KT_BENCH_RUNS";
/// kt-bench-s3: the ingest's concurrent requests (default: the ingest's).
pub const BENCH_CONCURRENCY: &str = "KT_BENCH_CONCURRENCY";
/// kt-bench-nccl sets it in a rank's child process: its rank.
pub const BENCH_NCCL_RANK: &str = "KT_BENCH_NCCL_RANK";
/// kt-bench-nccl sets it in a rank's child process: the NCCL id (hex).
pub const BENCH_NCCL_ID: &str = "KT_BENCH_NCCL_ID";
/// kt-bench-nccl sets it in a rank's child process: its CUDA device.
pub const BENCH_NCCL_DEVICE: &str = "KT_BENCH_NCCL_DEVICE";
/// kt-tensor's CUDA tests set it in a child process: the test to run.
pub const CUDA_TEST_CHILD: &str = "KT_CUDA_TEST_CHILD";
/// kt-tensor's CUDA tests, a child's part: its rank.
pub const CT_RANK: &str = "KT_CT_RANK";
/// kt-tensor's CUDA tests, a child's part: the number of ranks.
pub const CT_WORLD: &str = "KT_CT_WORLD";
/// kt-tensor's CUDA tests, a child's part: the NCCL id (hex).
pub const CT_ID: &str = "KT_CT_ID";
/// kt-tensor's CUDA tests, a child's part: its CUDA device.
pub const CT_DEVICE: &str = "KT_CT_DEVICE";
/// kt-tensor's CUDA tests, a child's part: a CUDA IPC handle (hex).
pub const CT_HANDLE: &str = "KT_CT_HANDLE";
/// kt-tensor's CUDA tests, a child's part: the UUID of the device the
/// handle is on (empty: unknown).
pub const CT_UUID: &str = "KT_CT_UUID";
/// kt-tensor's CUDA tests, a child's part: a length in bytes.
pub const CT_LEN: &str = "KT_CT_LEN";
/// kt-tensor's CUDA tests, a child's part: a timeout in milliseconds.
pub const CT_TIMEOUT_MS: &str = "KT_CT_TIMEOUT_MS";
/// A boolean ([`boolish`]), default off: kt-tensor's CUDA tests fail
/// instead of skipping when the GPU or NCCL cannot be used (`make
/// test-gpu` sets it).
pub const REQUIRE_GPU: &str = "KT_REQUIRE_GPU";

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
    let bad = || port_error(var, spec, "a port or a range such as 8091-8099");
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

/// The port a port variable (`var`, e.g. [`NODE_CACHE_PORT`]) names; a
/// clap `value_parser` for such a flag.
pub fn port(var: &str, value: &str) -> Result<u16, String> {
    let value = value.trim();
    value
        .parse()
        .map_err(|_| port_error(var, value, "a port such as 8090"))
}

/// The error of a port variable's bad `value`. A URL there
/// (`tcp://10.0.0.1:7000`) is Kubernetes' service links: the kubelet sets
/// `<SERVICE>_PORT` for every Service of the namespace in a pod without
/// `enableServiceLinks: false`, so a Service named `kt-relay` sets
/// `KT_RELAY_PORT`; the error says so.
fn port_error(var: &str, value: &str, want: &str) -> String {
    let mut msg = format!("{var}={value:?}: {want}");
    if value.contains("://") {
        let service = var
            .strip_suffix("_PORT")
            .unwrap_or(var)
            .to_ascii_lowercase()
            .replace('_', "-");
        msg.push_str(&format!(
            " (a URL there is what Kubernetes' service links set for a Service named \
             {service}: set `enableServiceLinks: false` on the pod, as kt's manifests do)"
        ));
    }
    msg
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

// Server settings (flags shared by the servers).

/// A boolean ([`boolish`]), default off: callers present projected
/// ServiceAccount tokens (audience kt); the metadata server reviews them
/// with the Kubernetes API, the store and agents ask the metadata server.
pub const KUBE_AUTH: &str = "KT_KUBE_AUTH";
/// How often node agents heartbeat to the metadata server (default `2s`).
pub const HEARTBEAT_INTERVAL: &str = "KT_HEARTBEAT_INTERVAL";
/// A boolean ([`boolish`]), default off: the metadata server watches its
/// namespace's pods and workloads labelled `kt.dev/service`.
pub const KUBE_WATCH: &str = "KT_KUBE_WATCH";
/// The metadata server's access map (YAML, with [`KUBE_AUTH`]): who may do
/// what, by ServiceAccount.
pub const ACCESS_MAP: &str = "KT_ACCESS_MAP";
/// The audience ServiceAccount tokens must be made for (with
/// [`KUBE_AUTH`]; default `kt`).
pub const TOKEN_AUDIENCE: &str = "KT_TOKEN_AUDIENCE";
/// Where the metadata server serves the sidecar injector webhook (unset:
/// no webhook).
pub const WEBHOOK_LISTEN: &str = "KT_WEBHOOK_LISTEN";
/// The webhook's PEM certificate chain.
pub const WEBHOOK_TLS_CERT: &str = "KT_WEBHOOK_TLS_CERT";
/// The PEM private key of [`WEBHOOK_TLS_CERT`].
pub const WEBHOOK_TLS_KEY: &str = "KT_WEBHOOK_TLS_KEY";
/// The pod template the sidecar injector injects.
pub const INJECT_TEMPLATE: &str = "KT_INJECT_TEMPLATE";
/// The image of the agent the sidecar injector injects.
pub const INJECT_AGENT_IMAGE: &str = "KT_INJECT_AGENT_IMAGE";
/// Bytes of the store's data volume no put may take (default: 2% of it,
/// at most 1 GiB).
pub const STORE_RESERVE: &str = "KT_STORE_RESERVE";
/// The URL under which peers reach a node agent (default: from
/// [`POD_IP`] and its listen port).
pub const AGENT_URL: &str = "KT_AGENT_URL";
/// The service a node agent's pod belongs to (announced with its
/// heartbeats; the sidecar takes it from the pod's `kt.dev/service` label).
pub const SERVICE: &str = "KT_SERVICE";
/// The group given a node agent's control socket (0660) and its directory
/// (0750), e.g. the pod's fsGroup.
pub const AGENT_SOCKET_GROUP: &str = "KT_AGENT_SOCKET_GROUP";
/// Where a node agent persists its exports (default: beside its socket,
/// `<socket>.state`).
pub const AGENT_STATE_DIR: &str = "KT_AGENT_STATE_DIR";
/// Directories whose files a node agent exports (comma-separated).
pub const EXPORT_ROOTS: &str = "KT_EXPORT_ROOTS";
/// Whose Datasets the Dataset controller obeys: namespaces, comma-separated,
/// or `*`.
pub const DATASET_NAMESPACES: &str = "KT_DATASET_NAMESPACES";
/// The port of the node-cache agents the Dataset controller calls
/// (default 8090).
pub const NODE_CACHE_PORT: &str = "KT_NODE_CACHE_PORT";
/// `http` or `https`: how the Dataset controller calls node-cache agents.
pub const NODE_CACHE_SCHEME: &str = "KT_NODE_CACHE_SCHEME";
/// How long a node-cache agent may take to answer the Dataset controller
/// (default `3s`).
pub const NODE_CACHE_TIMEOUT: &str = "KT_NODE_CACHE_TIMEOUT";
/// How long a seeding broadcast group of the Dataset controller accepts
/// joins (default `5s`).
pub const SEED_WINDOW: &str = "KT_SEED_WINDOW";
/// Where the Dataset controller's S3 ingests stage objects.
pub const STAGING_DIR: &str = "KT_STAGING_DIR";
/// The image (with `kt`) of the Dataset controller's PVC ingest Jobs.
pub const INGEST_IMAGE: &str = "KT_INGEST_IMAGE";
/// The metadata server's URL as ingest Jobs reach it.
pub const INGEST_METADATA_URL: &str = "KT_INGEST_METADATA_URL";
/// The Secret whose `token` key ingest Jobs present.
pub const INGEST_TOKEN_SECRET: &str = "KT_INGEST_TOKEN_SECRET";
/// The ServiceAccount ingest Jobs run as.
pub const INGEST_SERVICE_ACCOUNT: &str = "KT_INGEST_SERVICE_ACCOUNT";

// Arrow Flight settings.

/// Where an agent's Flight calls fetch their files (default: `flight`
/// below its state directory); its free space must hold
/// `KT_FLIGHT_BUDGET` times `KT_FLIGHT_MAX_CALLS`.
pub const FLIGHT_DIR: &str = "KT_FLIGHT_DIR";
/// Flight calls one token may hold at once on an agent (default 4).
pub const FLIGHT_MAX_CALLS_PER_TOKEN: &str = "KT_FLIGHT_MAX_CALLS_PER_TOKEN";
/// The most files the listing of one Flight call's prefix may hold
/// (default 1000000).
pub const FLIGHT_MAX_FILES: &str = "KT_FLIGHT_MAX_FILES";
/// The longest one Flight call may last (default `6h`).
pub const FLIGHT_MAX_DURATION: &str = "KT_FLIGHT_MAX_DURATION";

// Scenario runner settings.

/// `1`: kt-scenario takes CUDA as usable without asking `nvidia-smi`
/// (gpu scenarios then run).
pub const GPU: &str = "KT_GPU";
/// The target kt-scenario runs on: `local` (the default), `netns`,
/// `docker`, `kind`, `k3d`, ... (`--target`).
pub const SCENARIO_TARGET: &str = "KT_SCENARIO_TARGET";
/// kt-scenario skips scenarios with any of these tags (comma-separated;
/// `--exclude-tags`).
pub const SCENARIO_EXCLUDE_TAGS: &str = "KT_SCENARIO_EXCLUDE_TAGS";
/// Where kt-scenario writes its reports and failure dumps (`--report`).
pub const SCENARIO_REPORT: &str = "KT_SCENARIO_REPORT";
/// kt-scenario's snapshot directory (`--snapshots`).
pub const SCENARIO_SNAPSHOTS: &str = "KT_SCENARIO_SNAPSHOTS";
/// Where kt-scenario finds `kt`, `kt-metadata` and `kt-store`
/// (`--bin-dir`; default: beside itself).
pub const SCENARIO_BIN_DIR: &str = "KT_SCENARIO_BIN_DIR";
/// The Python interpreter with the `kt` package that `python` steps run
/// (`--python`).
pub const SCENARIO_PYTHON: &str = "KT_SCENARIO_PYTHON";
/// The parent of kt-scenario's per-scenario work directories
/// (`--work-dir`).
pub const SCENARIO_WORK_DIR: &str = "KT_SCENARIO_WORK_DIR";
/// The chaos soak's seed (`kt-scenario chaos --seed`).
pub const CHAOS_SEED: &str = "KT_CHAOS_SEED";

#[cfg(test)]
mod tests {
    use super::*;

    /// A Service named like a kt port variable sets it to a URL in pods
    /// with service links: the error names the variable and the cause.
    #[test]
    fn a_service_link_in_a_port_variable_is_named() {
        let e = ports(RELAY_PORT, "tcp://10.0.0.1:7000", "8091-8099").unwrap_err();
        assert!(
            e.starts_with("KT_RELAY_PORT=\"tcp://10.0.0.1:7000\""),
            "{e}"
        );
        assert!(e.contains("a Service named kt-relay"), "{e}");
        assert!(e.contains("enableServiceLinks: false"), "{e}");
        let e = port(NODE_CACHE_PORT, "tcp://10.0.0.2:8090").unwrap_err();
        assert!(e.starts_with("KT_NODE_CACHE_PORT="), "{e}");
        assert!(e.contains("a Service named kt-node-cache"), "{e}");
        let e = ports(TENSOR_PORT, "tcp://10.0.0.3:8100", DEFAULT_TENSOR_PORTS).unwrap_err();
        assert!(e.contains("a Service named kt-tensor"), "{e}");
        // A plain bad value says what is wanted, and nothing of services.
        let e = ports(RELAY_PORT, "80a", "8091-8099").unwrap_err();
        assert!(!e.contains("Service"), "{e}");
        assert_eq!(
            ports(RELAY_PORT, " 9000-9001 ", "").unwrap(),
            vec![9000, 9001]
        );
        assert_eq!(port(NODE_CACHE_PORT, "8090").unwrap(), 8090);
    }
}
