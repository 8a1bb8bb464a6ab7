//! The scenario file format: what a YAML file under `scenarios/` may say.
//!
//! Every struct refuses unknown fields, so a typo is an error with a line and a
//! column rather than a silently ignored option. A step is a mapping with
//! exactly one action key (`put`, `get`, ...) beside the fields every step has
//! (`name`, `expect`, `timeout`, `budget`, `record`); [`Step`]'s `Deserialize`
//! reads that shape directly from the YAML stream, so errors inside an action
//! keep their position too. The actions come from one table ([`step`]).
//!
//! GPU data (`kt tensor`) has its own steps:
//!
//! ```yaml
//! - tensor_put: { pod: trainer, key: "{{scenario}}/w", layout: "w=f32[256,256];b=f32[256]",
//!                 repeat: 50, seed: 7, hold: true, as: weights }   # stays up, registered
//! - tensor_get: { pod: worker, key: "{{scenario}}/w", layout: "...", repeat: 50, seed: 7 }
//!   record: p2p                    # tensors, bytes, collectives, digest (never seconds)
//! - parallel:                      # a broadcast put returns when the transfer is over
//!     - tensor_put: { pod: trainer, key: K, layout: L, seed: 1,
//!                     broadcast: { group: "g-{{run}}", world_size: 5, pack: true }, bucket: 1MiB }
//!     - tensor_get: { pod: worker, keys: [K], layout: L, seeds: [1],
//!                     broadcast: { group: "g-{{run}}", world_size: 5, window: 30s, ips: [trainer] } }
//! - tensor_ls: { pod: trainer }    # the agent's registrations, recorded
//! - stop: { holder: weights, signal: KILL }   # default TERM (must exit 0)
//! - restart: { agent: trainer }    # the pod's agent alone; its processes live on
//! ```
//!
//! `ips` names pods; `kt` gets their addresses. A `gpu`-tagged scenario (or
//! one with `gpu: true` pods) runs only where CUDA is usable.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer};

pub mod step;

pub use step::{ACTIONS, Action, ActionInfo, Step, TABLE};

/// One scenario file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Defaults to the file's stem; names the snapshot file.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    /// Selection labels (`slow`, `fault`, `netns`, `gpu`, ...).
    #[serde(default)]
    pub tags: Vec<String>,
    /// Wall-clock limit for the whole scenario (default 300s); every step's
    /// own limit (default 60s) is capped by what is left of it.
    #[serde(default, with = "opt_duration")]
    pub timeout: Option<Duration>,
    /// Values for `{{ vars.NAME }}`.
    #[serde(default)]
    pub vars: BTreeMap<String, String>,
    #[serde(default)]
    pub topology: Topology,
    /// Named data sets the generators make before the first step.
    #[serde(default)]
    pub data: BTreeMap<String, DataSpec>,
    pub steps: Vec<Step>,
    /// Steps that run after `steps`, also when one of them failed.
    #[serde(default)]
    pub finally: Vec<Step>,
}

impl Scenario {
    /// Does a step of `steps` or `finally`, or one nested in them, satisfy
    /// `p`?
    pub fn any_step(&self, p: impl Fn(&Step) -> bool) -> bool {
        self.steps.iter().chain(&self.finally).any(|s| s.any(&p))
    }
}

/// What the testbed runs.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Default link rate of every pod (netns target), e.g. `1gbit`.
    #[serde(default)]
    pub link: Option<String>,
    #[serde(default)]
    pub metadata: MetadataSpec,
    #[serde(default)]
    pub store: StoreSpec,
    #[serde(default)]
    pub pods: Vec<PodSpec>,
    /// Kubernetes nodes (`nodes: 12` or `{ count: 12, labels: {...} }`):
    /// an in-memory API server, `node-1`..`node-N` with a node-cache agent
    /// each, and the Dataset controller (see `crate::datasets`).
    #[serde(default)]
    pub nodes: Option<crate::datasets::NodesSpec>,
    /// An S3 server (`s3: true` or `{ buckets: [...] }`): moto's, with the
    /// buckets created, its endpoint as `{{s3}}` (see `crate::s3`).
    #[serde(default)]
    pub s3: Option<crate::s3::S3Spec>,
    /// A real Prometheus scraping the servers and agents (`prometheus:
    /// true` or `{ scrape_interval: 500ms }`), queried by `promql` steps
    /// (see `crate::prometheus`).
    #[serde(default)]
    pub prometheus: Option<crate::prometheus::PrometheusSpec>,
}

/// Timing knobs of the metadata server (faster than production defaults
/// make fault scenarios quick).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetadataSpec {
    /// Agents silent this long are evicted as sources.
    #[serde(default)]
    pub agent_ttl: Option<String>,
    /// How often agents beat.
    #[serde(default)]
    pub heartbeat_interval: Option<String>,
    /// Source leases not renewed this long expire.
    #[serde(default)]
    pub lease_ttl: Option<String>,
}

impl MetadataSpec {
    /// The metadata server flags these settings make.
    pub fn flags(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (flag, v) in [
            ("--agent-ttl", &self.agent_ttl),
            ("--heartbeat-interval", &self.heartbeat_interval),
            ("--lease-ttl", &self.lease_ttl),
        ] {
            if let Some(v) = v {
                out.extend([flag.to_owned(), v.clone()]);
            }
        }
        out
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSpec {
    /// Chunk size of the store (a power of two), e.g. `1MiB`.
    #[serde(default)]
    pub chunk_size: Option<Size>,
    /// Link rate of the store's node (netns target), e.g. `1gbit`, shaped in
    /// both directions like a pod's link. Unlike pods, the store does not
    /// take the topology's `link`: it is unshaped unless this is set.
    #[serde(default)]
    pub link: Option<String>,
}

/// A group of identical pods. One replica is named `name`; several are
/// `name-0` .. `name-(n-1)`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodSpec {
    pub name: String,
    #[serde(default = "one")]
    pub replicas: usize,
    /// The service the pods belong to (teardown evicts them).
    #[serde(default)]
    pub service: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub gpu: bool,
    /// Link rate for these pods (netns target), overriding the topology's.
    #[serde(default)]
    pub link: Option<String>,
    /// The Kubernetes node these pods run on (process targets: their
    /// agents' `KT_NODE_NAME`, so a quorum plans the pods of one node
    /// together; a cluster's pods keep the node they were scheduled on).
    #[serde(default)]
    pub node: Option<String>,
}

fn one() -> usize {
    1
}

fn yes() -> bool {
    true
}

/// A generated data set: a deterministic tree, a single file, or another
/// data set with changes applied.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    #[serde(default)]
    pub seed: u64,
    /// Number of small files.
    #[serde(default)]
    pub files: usize,
    /// Size range of the small files (log-uniform between min and max).
    #[serde(default)]
    pub size: Option<SizeRange>,
    /// Directories the small files are spread over (nested up to 3 deep).
    #[serde(default)]
    pub dirs: Option<usize>,
    /// Large files added to the tree.
    #[serde(default)]
    pub large: Vec<Size>,
    /// A single file of this size instead of a tree.
    #[serde(default)]
    pub file: Option<Size>,
    /// Start from a copy of this data set, then apply `change`/`add`/`delete`.
    #[serde(default)]
    pub from: Option<String>,
    #[serde(default)]
    pub change: usize,
    #[serde(default)]
    pub add: usize,
    #[serde(default)]
    pub delete: usize,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SizeRange {
    pub min: Size,
    pub max: Size,
}

/// A byte count written as `123`, `64KiB`, `1MiB`, `2GiB` (binary) or
/// `1kB`, `1MB` (decimal).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Size(pub u64);

impl Size {
    /// kt's one size grammar ([`kt_client::size::parse`]).
    pub fn parse(s: &str) -> Result<Size, String> {
        kt_client::size::parse(s).map(Size)
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&kt_types::size::human(self.0))
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Size;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as 4096, 64KiB or 1MiB")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Size, E> {
                Ok(Size(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Size, E> {
                u64::try_from(v)
                    .map(Size)
                    .map_err(|_| E::custom("a size cannot be negative"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Size, E> {
                Size::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A topology switch written `true` (on, with its defaults) or as a
/// mapping of settings `T` (`s3`, `prometheus`); `false` is refused, since
/// it says what leaving the key out says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnOrSpec<T> {
    On,
    Spec(T),
}

impl<T> OnOrSpec<T> {
    /// Reads the value of the topology's `key`.
    pub fn deserialize_for<'de, D: Deserializer<'de>>(d: D, key: &str) -> Result<Self, D::Error>
    where
        T: Deserialize<'de>,
    {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form<T> {
            On(bool),
            Spec(T),
        }
        match Form::deserialize(d)? {
            Form::On(true) => Ok(OnOrSpec::On),
            Form::On(false) => Err(de::Error::custom(format!(
                "`{key}: false` is the same as leaving `{key}` out; leave it out"
            ))),
            Form::Spec(s) => Ok(OnOrSpec::Spec(s)),
        }
    }
}

/// `humantime` durations (`500ms`, `10s`, `2m`) in YAML.
pub(crate) mod opt_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let s: Option<String> = Option::deserialize(d)?;
        s.map(|s| humantime::parse_duration(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// What a step must end with.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Expect {
    /// Success (the default).
    #[default]
    Ok,
    /// Failure: a class of error and, optionally, a regex its message matches.
    Error {
        code: ErrorClass,
        message: Option<String>,
    },
}

/// Error classes, as the `kt` CLI's exit codes tell them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorClass {
    /// Any failure.
    Any,
    /// Exit 2: bad input (key, request, manifest, conflict).
    Invalid,
    /// Exit 3.
    NotFound,
    /// Exit 4.
    Unauthorized,
    /// Exit 5: no store, server unavailable.
    Unavailable,
    /// Exit 1: anything else (I/O, network, killed server mid-transfer).
    Failed,
}

impl ErrorClass {
    /// The class a `kt` exit status belongs to.
    pub fn of_exit(code: i32) -> ErrorClass {
        match code {
            2 => ErrorClass::Invalid,
            3 => ErrorClass::NotFound,
            4 => ErrorClass::Unauthorized,
            5 => ErrorClass::Unavailable,
            _ => ErrorClass::Failed,
        }
    }

    pub fn accepts(self, other: ErrorClass) -> bool {
        self == ErrorClass::Any || self == other
    }
}

impl<'de> Deserialize<'de> for Expect {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct ErrorForm {
            error: ErrorClass,
            #[serde(default)]
            message: Option<String>,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            Word(String),
            Error(ErrorForm),
        }
        match Form::deserialize(d)? {
            Form::Word(w) if w == "ok" => Ok(Expect::Ok),
            Form::Word(w) => Err(de::Error::custom(format!(
                "expect must be `ok` or {{ error: CLASS, message: REGEX }}, not `{w}`"
            ))),
            Form::Error(e) => Ok(Expect::Error {
                code: e.error,
                message: e.message,
            }),
        }
    }
}

/// Limits on a step's duration. `max` applies to every pod; `p50`/`p95` to
/// the distribution across the pods of a multi-pod step; `min` is a floor
/// (a shaped link must not be faster than its rate).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    #[serde(default, with = "opt_duration")]
    pub max: Option<Duration>,
    #[serde(default, with = "opt_duration")]
    pub p50: Option<Duration>,
    #[serde(default, with = "opt_duration")]
    pub p95: Option<Duration>,
    #[serde(default, with = "opt_duration")]
    pub min: Option<Duration>,
}

/// Which credentials a client step presents.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Auth {
    #[default]
    Valid,
    Missing,
    Wrong,
}

/// A testbed component that `kill`/`restart`/`wait` name: `metadata`,
/// `store`, or a pod (group or instance) name.
pub type ComponentName = String;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
pub enum Signal {
    #[serde(alias = "SIGKILL", alias = "kill")]
    #[default]
    KILL,
    #[serde(alias = "SIGTERM", alias = "term")]
    TERM,
    /// Freezes it: it neither answers nor resets (a hung process, a node
    /// under memory pressure). Not waited for; `CONT` thaws it.
    #[serde(alias = "SIGSTOP", alias = "stop")]
    STOP,
    /// Thaws what `STOP` froze.
    #[serde(alias = "SIGCONT", alias = "cont")]
    CONT,
}

impl Signal {
    /// The name `kill -s` takes.
    pub fn name(self) -> &'static str {
        match self {
            Signal::KILL => "KILL",
            Signal::TERM => "TERM",
            Signal::STOP => "STOP",
            Signal::CONT => "CONT",
        }
    }

    /// STOP or CONT: the process lives on (nothing waits for its exit).
    pub fn freezes(self) -> bool {
        matches!(self, Signal::STOP | Signal::CONT)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PutStep {
    pub pod: String,
    pub key: String,
    /// A data set name (from `data:`).
    #[serde(default)]
    pub data: Option<String>,
    /// Or a path inside the pod (e.g. what an earlier get wrote).
    #[serde(default)]
    pub src: Option<String>,
    /// `store` (default) or `local` (the pod's agent serves it; zero copy).
    #[serde(default)]
    pub locale: Option<String>,
    #[serde(default)]
    pub lifespan: Option<String>,
    #[serde(default)]
    pub ttl: Option<String>,
    #[serde(default)]
    pub service: Option<String>,
    #[serde(default)]
    pub auth: Auth,
    /// Upper bound on the content bytes this put may send (incremental sync).
    #[serde(default)]
    pub max_sent: Option<Size>,
    /// How long it waits for failed sources (`--deadline`), e.g. `30s`.
    #[serde(default)]
    pub deadline: Option<String>,
    /// Its stall timeout (`--stall-timeout`), e.g. `2s`.
    #[serde(default)]
    pub stall_timeout: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GetStep {
    /// A pod group (every replica fetches, in parallel) or one instance.
    pub pod: String,
    pub key: String,
    /// Destination inside each pod (default `get/<key>`).
    #[serde(default)]
    pub dest: Option<String>,
    /// Data set(s) the received tree must equal (one of them, when several).
    #[serde(default)]
    pub verify: Vec<String>,
    /// Have the pod's agent serve the copy afterwards (default true).
    #[serde(default = "yes")]
    pub serve: bool,
    /// A mirror get (`kt get --delete`): afterwards the destination holds
    /// exactly the key's tree.
    #[serde(default)]
    pub delete: bool,
    #[serde(default)]
    pub auth: Auth,
    #[serde(default)]
    pub max_sent: Option<Size>,
    /// `broadcast` steps only: the group id, unique per run (use `{{run}}`);
    /// default: the key's open group.
    #[serde(default)]
    pub group: Option<String>,
    /// `broadcast` steps only: children per node of the tree.
    #[serde(default)]
    pub fanout: Option<u32>,
    /// How long it waits for failed sources (`--deadline`), e.g. `30s`.
    #[serde(default)]
    pub deadline: Option<String>,
    /// Its stall timeout (`--stall-timeout`), e.g. `2s`.
    #[serde(default)]
    pub stall_timeout: Option<String>,
    /// `broadcast` steps only: how long the group accepts joins (e.g. `30s`).
    #[serde(default)]
    pub window: Option<String>,
    /// `broadcast` steps only: record where each member's time went
    /// (`members`, by rank). Times differ from run to run: for benchmarks,
    /// whose snapshots hold measurements, not expectations.
    #[serde(default)]
    pub timings: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LsStep {
    #[serde(default)]
    pub prefix: String,
    /// Run `kt ls` in this pod (default: the first pod).
    #[serde(default)]
    pub pod: Option<String>,
    #[serde(default)]
    pub auth: Auth,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RmStep {
    pub key: String,
    #[serde(default)]
    pub recursive: bool,
    #[serde(default)]
    pub pod: Option<String>,
    #[serde(default)]
    pub auth: Auth,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TeardownStep {
    pub service: String,
    /// Run `kt teardown` in this pod (default: the first pod).
    #[serde(default)]
    pub pod: Option<String>,
}

/// `kill: { component: NAME }` (a server, or a pod: its commands and its
/// agent) or `kill: { agent: POD }` (the pod's node agent alone: its
/// commands, such as tensor holders, live on).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KillStep {
    #[serde(default)]
    pub component: Option<ComponentName>,
    #[serde(default)]
    pub agent: Option<String>,
    /// A node of the topology's `nodes` (`node-3`): its node-cache agent
    /// dies and the API marks the node NotReady (node lost).
    #[serde(default)]
    pub node: Option<String>,
    #[serde(default)]
    pub signal: Signal,
}

/// `link: { component: NAME, state: down }` cuts the network link of a
/// server or pod (group or instance), as when a node loses its network:
/// its packets are dropped, so open connections stall and new ones fail as
/// unreachable once address resolution gives up; `state: up` restores it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkStep {
    pub component: ComponentName,
    pub state: LinkState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkState {
    Down,
    Up,
}

/// `restart: { component: NAME }` or `restart: { agent: POD }` (see
/// [`KillStep`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestartStep {
    #[serde(default)]
    pub component: Option<ComponentName>,
    #[serde(default)]
    pub agent: Option<String>,
    /// How the running process is stopped first (default TERM).
    #[serde(default)]
    pub signal: Option<Signal>,
}

/// What a `kill` or `restart` step reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Victim<'a> {
    /// `metadata`, `store`, or a pod (group or instance) with its commands.
    Component(&'a str),
    /// The node agents of a pod (group or instance), alone.
    Agent(&'a str),
}

/// The one victim of `component`/`agent`; Err when not exactly one is set.
pub fn victim<'a>(
    component: &'a Option<ComponentName>,
    agent: &'a Option<String>,
) -> Result<Victim<'a>, &'static str> {
    match (component, agent) {
        (Some(c), None) => Ok(Victim::Component(c)),
        (None, Some(a)) => Ok(Victim::Agent(a)),
        _ => Err(
            "name exactly one of `component` (metadata, store or a pod) or `agent` (a pod's agent alone)",
        ),
    }
}

impl KillStep {
    /// The component or agent it kills (Err for a `node` kill, which
    /// [`crate::runner`] handles on its own).
    pub fn victim(&self) -> Result<Victim<'_>, &'static str> {
        if self.node.is_some() {
            return Err("a node kill names `node` alone");
        }
        victim(&self.component, &self.agent)
    }
}

impl RestartStep {
    pub fn victim(&self) -> Result<Victim<'_>, &'static str> {
        victim(&self.component, &self.agent)
    }
}

/// Quorum options of `tensor_put` and `tensor_get` (`kt tensor ...
/// --broadcast`): the quorum closes on `world_size`, on `window` after its
/// first join, or once every pod of `ips` joined, whichever comes first.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorBroadcast {
    /// The quorum's group id (use `{{run}}`); default: one group per key.
    #[serde(default)]
    pub group: Option<String>,
    /// Pods (putters and getters) that close the quorum.
    #[serde(default)]
    pub world_size: Option<u32>,
    /// How long after its first join the quorum closes, e.g. `2s`.
    #[serde(default)]
    pub window: Option<String>,
    /// Pods (groups or instances) whose joins close the quorum; `kt` gets
    /// their addresses.
    #[serde(default)]
    pub ips: Vec<String>,
    /// Children per node of the host backend's tree.
    #[serde(default)]
    pub fanout: Option<u32>,
    /// Every tensor of one dtype as one buffer (in buckets of `bucket`).
    #[serde(default)]
    pub pack: bool,
}

/// `kt tensor put`: generated tensors (a layout, contents from a seed and
/// each tensor's name) registered with the pod's agent. A pod group puts
/// from every replica at once. With `hold`, the process stays in the pod
/// (registrations live as long as their process) under the name `as`,
/// until a `stop` step or the scenario's end; without it, the command
/// returns once the key is published or, with `broadcast`, once the
/// quorum's transfer is over.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorPutStep {
    pub pod: String,
    pub key: String,
    /// `name=dtype[d0,d1];...`, or one unnamed `dtype[d0,...]`.
    pub layout: String,
    /// Copies of the layout (a state dict), names suffixed `.0`, `.1`, ...
    #[serde(default)]
    pub repeat: Option<u32>,
    #[serde(default)]
    pub seed: Option<u64>,
    /// `cpu` (default; shared memory, host backend) or `cuda:N`.
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub lifespan: Option<String>,
    #[serde(default)]
    pub ttl: Option<String>,
    #[serde(default)]
    pub service: Option<String>,
    #[serde(default)]
    pub broadcast: Option<TensorBroadcast>,
    /// Pack bucket size.
    #[serde(default)]
    pub bucket: Option<Size>,
    #[serde(default)]
    pub hold: bool,
    /// The holder's name for `stop` (with `hold`).
    #[serde(default, rename = "as")]
    pub name: Option<String>,
    #[serde(default)]
    pub auth: Auth,
}

/// `kt tensor get`: every pod of `pod` allocates tensors of `layout` for
/// each key, receives into them (peer to peer, or through the quorum with
/// `broadcast`) and checks every byte against `seed` (one for every key) or
/// `seeds` (one per key).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorGetStep {
    pub pod: String,
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub keys: Vec<String>,
    pub layout: String,
    #[serde(default)]
    pub repeat: Option<u32>,
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub seeds: Vec<u64>,
    #[serde(default)]
    pub broadcast: Option<TensorBroadcast>,
    /// Peer to peer: `false` moves one tensor per collective (`--no-pack`).
    #[serde(default = "yes")]
    pub pack: bool,
    #[serde(default)]
    pub bucket: Option<Size>,
    #[serde(default)]
    pub auth: Auth,
}

impl TensorGetStep {
    /// `key` and `keys` together, in order.
    pub fn all_keys(&self) -> Vec<&str> {
        self.key
            .iter()
            .chain(&self.keys)
            .map(String::as_str)
            .collect()
    }

    /// The `--seed` values.
    pub fn all_seeds(&self) -> Vec<u64> {
        self.seed.iter().chain(&self.seeds).copied().collect()
    }
}

/// `kt tensor ls` in a pod: its agent's registrations go into the record.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorLsStep {
    pub pod: String,
    #[serde(default)]
    pub auth: Auth,
}

/// Signals the processes a `tensor_put` with `hold` left under `holder`
/// and waits for them to end. TERM (the default) must end them cleanly
/// (exit 0); KILL is the process dying under its registrations.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StopStep {
    pub holder: String,
    #[serde(default)]
    pub signal: Option<Signal>,
}

/// A condition `wait` polls until it holds (or the step times out), written
/// as a mapping with one key: `{ ready: store }`, `{ key: K }`,
/// `{ no_key: K }` or `{ metric: { component, name, at_least } }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "ConditionForm")]
pub enum Condition {
    /// The component answers `/readyz`.
    Ready(ComponentName),
    /// The key exists in the metadata server.
    Key(String),
    /// The key does not exist.
    NoKey(String),
    /// A Prometheus counter of a server reaches a value.
    Metric(MetricCondition),
    /// At most this many source leases are active (load returned to zero).
    Leases(usize),
    /// A key has at least this many peers (getters serving it).
    Peers(PeersCondition),
    /// A broadcast group has at least this many members (joined getters).
    Members(MembersCondition),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MembersCondition {
    pub group: String,
    pub at_least: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeersCondition {
    pub key: String,
    pub at_least: usize,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConditionForm {
    #[serde(default)]
    ready: Option<ComponentName>,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    no_key: Option<String>,
    #[serde(default)]
    metric: Option<MetricCondition>,
    #[serde(default)]
    leases: Option<usize>,
    #[serde(default)]
    peers: Option<PeersCondition>,
    #[serde(default)]
    members: Option<MembersCondition>,
}

impl TryFrom<ConditionForm> for Condition {
    type Error = String;
    fn try_from(f: ConditionForm) -> Result<Condition, String> {
        let mut found = Vec::new();
        if let Some(c) = f.ready {
            found.push(Condition::Ready(c));
        }
        if let Some(k) = f.key {
            found.push(Condition::Key(k));
        }
        if let Some(k) = f.no_key {
            found.push(Condition::NoKey(k));
        }
        if let Some(m) = f.metric {
            found.push(Condition::Metric(m));
        }
        if let Some(n) = f.leases {
            found.push(Condition::Leases(n));
        }
        if let Some(p) = f.peers {
            found.push(Condition::Peers(p));
        }
        if let Some(m) = f.members {
            found.push(Condition::Members(m));
        }
        match found.len() {
            1 => Ok(found.remove(0)),
            _ => Err(
                "a wait names exactly one condition: ready, key, no_key, metric, leases, peers or members"
                    .into(),
            ),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricCondition {
    pub component: ComponentName,
    /// Sample name as exposed, e.g. `kt_bytes_received_total`.
    pub name: String,
    pub at_least: Size,
}

/// `metrics: { component: worker, name: kt_process_peak_resident_bytes,
/// at_most: 64MiB }`: the sample of every instance, their count, minimum,
/// median and maximum go into the step's record; `at_most` bounds the
/// maximum.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsStep {
    pub component: ComponentName,
    pub name: String,
    #[serde(default)]
    pub at_most: Option<Size>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitStep {
    #[serde(rename = "for")]
    pub condition: Condition,
}

/// Checks on the metadata server's state.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssertStep {
    /// Keys below this prefix (recursively)...
    #[serde(default)]
    pub prefix: Option<String>,
    /// ...number exactly this many.
    #[serde(default)]
    pub count: Option<usize>,
    /// These keys exist.
    #[serde(default)]
    pub exists: Vec<String>,
    /// These keys do not.
    #[serde(default)]
    pub absent: Vec<String>,
    /// Files in a pod equal a data set: `{ pod: p, path: get/x, data: tree }`.
    #[serde(default)]
    pub files: Option<FilesCheck>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilesCheck {
    pub pod: String,
    pub path: String,
    pub data: String,
}

/// What a `snapshot` step records into the scenario's snapshot.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotStep {
    /// Entry name inside the scenario's snapshot.
    pub name: String,
    /// `metadata` (every key record) or `ls` of a prefix.
    #[serde(default)]
    pub metadata: bool,
    #[serde(default)]
    pub ls: Option<String>,
}

/// Runs the `kt` CLI (or, with `program`, another program) inside a pod.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecStep {
    pub pod: String,
    pub args: Vec<String>,
    /// `kt` (default) or `sh`.
    #[serde(default)]
    pub program: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub auth: Auth,
    /// A regex stdout must match.
    #[serde(default)]
    pub stdout: Option<String>,
}

/// Runs a Python script inside a pod with the interpreter that has the `kt`
/// package (`make python`): `python -c SCRIPT ARGS...`. The script is
/// passed as written (no `{{ }}` expansion: Python uses braces); `args`
/// are expanded and reach it as `sys.argv[1:]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PythonStep {
    pub pod: String,
    pub script: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub auth: Auth,
    /// A regex stdout must match.
    #[serde(default)]
    pub stdout: Option<String>,
}
