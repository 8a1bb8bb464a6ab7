//! The Dataset controller: kube-rs's runtime around [`crate::reconcile`].
//!
//! Each reconcile of a Dataset gathers what [`reconcile::reconcile`] needs
//! — every Node, the node-cache pods of `--namespace` (label
//! [`NODE_CACHE_SELECTOR`], Running and Ready, with a pod IP and a node,
//! and passing [`NodeCachePods`]' checks) and each one's
//! `GET /api/v1/datasets` (a short time limit: an agent that
//! does not answer is unreachable, which the reconcile handles, not an
//! error), and the source (a key's record from the metadata server; an
//! ingest's state) — then carries the plan out: seeds and unseeds through
//! [`crate::nodes`], node labels by a merge patch on the Node, events by
//! [`Recorder`], and the status by server-side apply on the status
//! subresource (field manager [`FIELD_MANAGER`]), written only when it
//! changed.
//!
//! Who may use it (the trust rule): the controller reads keys, Secrets and
//! claims and writes node labels with its own rights (an admin kt token, a
//! ServiceAccount that patches Nodes), so a Dataset is obeyed only in the
//! namespaces [`Config::datasets`] names — by default the controller's own,
//! the kt install's, whose keys it serves ([`Namespaces`]). Whoever may
//! create a Dataset there may place any key of this kt install on nodes, and
//! have the controller read the namespace's Secrets named as
//! `credentialsSecret` (sending them to the Dataset's S3 endpoint) and its
//! PVCs (a Job of that namespace mounts the claim): grant `create` on
//! datasets there as you would grant admin of the kt install. A Dataset in
//! any other namespace is not touched (no finalizer, no status), and the
//! RBAC grants nothing there.
//!
//! Invariants:
//! - The finalizer [`FINALIZER`] is on every Dataset the controller has
//!   seen; it is removed (kube's `finalizer` helper) only once the plan for
//!   the deleted Dataset says nothing is left on any reachable node.
//! - Reconciles are triggered by a Dataset changing, by any Node or
//!   node-cache Pod changing (every Dataset is looked at again), by an
//!   ingest Job of the Dataset changing, and by the plan's requeue. The
//!   status is written only when it changed, so a reconcile's own write
//!   wakes at most one more that writes nothing.
//! - A seed an agent refuses (no room: `insufficient_storage`) marks that
//!   node `Failed` in the status written, so the next reconcile places the
//!   dataset elsewhere.
//! - A deleted Dataset's ingested key (`reclaimPolicy: Delete`,
//!   [`Action::DeleteIngested`]) is deleted only once nothing can put it
//!   back: a running PVC ingest Job is deleted with foreground propagation
//!   and reads as running until it is gone (its pods first); an S3 ingest
//!   thread, cancelled, is waited for until it ended. Then the finalizer
//!   goes. A store that cannot be asked holds the finalizer (retried).
//! - PVC ingest Jobs present the ServiceAccount token of
//!   [`PvcIngest::service_account`] (kube identities) when set, else the
//!   static token's Secret [`PvcIngest::token_secret`].

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kt_types::dataset::NodeReport;
use kt_types::{ErrorCode, Key};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action as Requeue, Config as ControllerConfig, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType as KubeEventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalize, finalizer};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::crd::{Dataset, DatasetStatus, IngestStatus, NodeState, PvcSource, S3Source, Source};
use crate::ingest::{self, IngestError, IngestEvent, OnProgress, S3Config, S3Credentials};
use crate::metrics::Stats;
use crate::nodes::NodeCaches;
use crate::reconcile::{
    self, Action, Agent, DatasetView, EventType, IngestState, Observed, ObservedNode, Plan,
    Settings, SourceState,
};

/// The Dataset's finalizer.
pub const FINALIZER: &str = "kt.dev/dataset";
/// The field manager of status writes.
pub const FIELD_MANAGER: &str = "kt-dataset-controller";
/// The label selector of node-cache pods.
pub const NODE_CACHE_SELECTOR: &str = "app.kubernetes.io/component=node-cache";
/// The label on ingest Jobs naming their Dataset.
pub const DATASET_LABEL: &str = "kt.dev/dataset";
/// The annotation on an ingest Job recording the source it ingests (JSON).
pub const SOURCE_ANNOTATION: &str = "kt.dev/source";

pub use crate::reconcile::ingest_key;

/// What a reconcile can fail with (the error policy looks again soon).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    #[error("the Dataset has no namespace")]
    NoNamespace,
    #[error("still removing the dataset from its nodes")]
    CleanupPending,
    #[error("deleting the ingested key {key}: {message}")]
    DeleteIngested { key: String, message: String },
}

/// How PVC sources are put into the store: a Job running `kt put`.
#[derive(Debug, Clone)]
pub struct PvcIngest {
    /// The image with the `kt` CLI.
    pub image: String,
    /// The metadata server's URL as the Job's pod reaches it.
    pub metadata_url: String,
    /// A Secret in the Dataset's namespace whose `token` key is the token
    /// the Job presents, when `service_account` is unset (an install with
    /// the static token).
    pub token_secret: String,
    /// The ServiceAccount (in the Dataset's namespace) the Job runs as,
    /// presenting its projected token (audience [`kt_kube::review::AUDIENCE`])
    /// instead of the Secret: an install with kube identities, whose
    /// access map gives it what `kt put datasets/<ns>/<name>` needs.
    pub service_account: Option<String>,
}

/// Which namespaces' Datasets the controller obeys (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Namespaces {
    /// Only these (the default: the controller's own namespace).
    Only(std::collections::BTreeSet<String>),
    /// Every namespace (`*`): for a cluster whose every namespace is
    /// trusted with every key of this kt install (a testbed, one team).
    All,
}

impl Namespaces {
    /// Just `namespace`.
    pub fn own(namespace: &str) -> Namespaces {
        Namespaces::Only([namespace.to_owned()].into())
    }

    /// `*`, or namespaces separated by commas.
    pub fn parse(s: &str) -> Result<Namespaces, String> {
        if s.trim() == "*" {
            return Ok(Namespaces::All);
        }
        let set: std::collections::BTreeSet<String> = s
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .collect();
        if set.is_empty() {
            return Err("no namespace named (`*` for every namespace)".into());
        }
        if let Some(bad) = set.iter().find(|n| {
            n.len() > 63
                || !n
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        }) {
            return Err(format!("{bad:?} is not a namespace name"));
        }
        Ok(Namespaces::Only(set))
    }

    /// Whether Datasets of `namespace` are obeyed.
    pub fn contains(&self, namespace: &str) -> bool {
        match self {
            Namespaces::All => true,
            Namespaces::Only(set) => set.contains(namespace),
        }
    }

    /// The one namespace, when there is just one (watched alone).
    fn single(&self) -> Option<&str> {
        match self {
            Namespaces::Only(set) if set.len() == 1 => set.iter().next().map(String::as_str),
            _ => None,
        }
    }
}

/// Which pods are node-cache agents, and where they listen.
///
/// The controller calls each agent with its own token (kt admin), so a pod
/// is one only if the node-cache DaemonSet made it: a controller
/// ownerReference to that DaemonSet, and its ServiceAccount. The label
/// alone is no proof: whoever may create or label a pod in the namespace
/// sets it. The port is the controller's, not the pod's, so a pod cannot
/// steer the token to another listener of its node. (Who may create pods
/// naming the DaemonSet as owner and running as its ServiceAccount passes;
/// that is the namespace's gate to keep, as for kt's other accounts.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCachePods {
    /// The DaemonSet that owns them (the bundle's `kt-node-cache`).
    pub daemonset: String,
    /// The ServiceAccount they run as (the bundle's `kt-node-cache`).
    pub service_account: String,
    /// Take each agent's port from its pod (the port named `node-cache` or
    /// `http`) rather than [`NodeCaches::port`]: for testbeds whose agents
    /// listen on ports of their own. Off in an install.
    pub port_from_pod: bool,
}

impl Default for NodeCachePods {
    /// The bundle's node-cache component.
    fn default() -> Self {
        NodeCachePods {
            daemonset: "kt-node-cache".to_owned(),
            service_account: "kt-node-cache".to_owned(),
            port_from_pod: false,
        }
    }
}

impl NodeCachePods {
    /// Why `pod` is not one of the DaemonSet's pods; `None`: it is.
    fn refuse(&self, pod: &Pod) -> Option<String> {
        let owned = pod.metadata.owner_references.iter().flatten().any(|o| {
            o.controller == Some(true)
                && o.kind == "DaemonSet"
                && o.api_version == "apps/v1"
                && o.name == self.daemonset
        });
        if !owned {
            return Some(format!("not owned by DaemonSet {}", self.daemonset));
        }
        let account = pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.as_deref());
        if account != Some(self.service_account.as_str()) {
            return Some(format!(
                "runs as ServiceAccount {:?}, not {}",
                account.unwrap_or("default"),
                self.service_account
            ));
        }
        None
    }
}

/// The controller's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the node-cache pods run (the kt install's namespace).
    pub namespace: String,
    /// Whose Datasets are obeyed ([`Namespaces::own`] of `namespace`
    /// unless the operator says otherwise).
    pub datasets: Namespaces,
    pub settings: Settings,
    /// PVC sources; `None`: they fail with reason `Unsupported`.
    pub pvc: Option<PvcIngest>,
    /// S3 ingests stage objects below `<staging_dir>/<namespace>/<name>`
    /// (kept between ingests: what makes a refresh move only what changed).
    pub staging_dir: std::path::PathBuf,
    /// Which labelled pods are node-cache agents.
    pub node_cache_pods: NodeCachePods,
}

/// A Dataset, by namespace and name.
type IngestKey = (String, String);

/// The ingest of one Dataset's S3 source, run by this process.
#[derive(Debug)]
struct IngestTask {
    state: IngestState,
    /// Running: cancelled when the Dataset goes or a new ingest replaces
    /// it.
    task: Option<CancellationToken>,
    /// Set before `task` is cancelled because the Dataset is gone: the
    /// ingest's thread then removes its staging directory once it stopped
    /// writing there.
    purge: Arc<std::sync::atomic::AtomicBool>,
}

type Ingests = Arc<Mutex<HashMap<IngestKey, IngestTask>>>;

/// The ingest threads of each Dataset still alive: each holds a clone of
/// its Dataset's `Arc` until it ends (a cancelled one too, until it stopped
/// putting), so `strong_count - 1` of them run.
type IngestThreads = Arc<Mutex<HashMap<IngestKey, Arc<()>>>>;

/// The shared state of reconciles.
pub struct Context {
    kube: kube::Client,
    kt: kt_client::Client,
    caches: NodeCaches,
    recorder: Recorder,
    config: Config,
    ingests: Ingests,
    threads: IngestThreads,
    stats: Stats,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Context {
    pub fn new(
        kube: kube::Client,
        kt: kt_client::Client,
        caches: NodeCaches,
        config: Config,
    ) -> Arc<Context> {
        let recorder = Recorder::new(kube.clone(), Reporter::from(FIELD_MANAGER));
        Arc::new(Context {
            kube,
            kt,
            caches,
            recorder,
            config,
            ingests: Ingests::default(),
            threads: IngestThreads::default(),
            stats: Stats::default(),
        })
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }
}

/// Runs the controller until `shutdown` is cancelled.
pub async fn run(ctx: Arc<Context>, shutdown: CancellationToken) {
    // One namespace: watched alone (a Role there is enough); several or
    // every one: watched cluster-wide and filtered (a ClusterRole).
    let scope = ctx.config.datasets.single().map(str::to_owned);
    let datasets: Api<Dataset> = match &scope {
        Some(ns) => Api::namespaced(ctx.kube.clone(), ns),
        None => Api::all(ctx.kube.clone()),
    };
    tracing::info!(namespaces = ?ctx.config.datasets, node_caches = %ctx.config.namespace, "watching Datasets");
    let controller = Controller::new(datasets, watcher::Config::default());
    let reader = controller.store();
    let on_nodes = every_dataset(reader.clone());
    let on_pods = every_dataset(reader.clone());
    let mut controller = controller
        .with_config(ControllerConfig::default().debounce(Duration::from_millis(200)))
        .watches(
            Api::<Node>::all(ctx.kube.clone()),
            watcher::Config::default(),
            on_nodes,
        )
        .watches(
            Api::<Pod>::namespaced(ctx.kube.clone(), &ctx.config.namespace),
            watcher::Config::default().labels(NODE_CACHE_SELECTOR),
            on_pods,
        );
    if ctx.config.pvc.is_some() {
        let jobs = match &scope {
            Some(ns) => Api::<Job>::namespaced(ctx.kube.clone(), ns),
            None => Api::<Job>::all(ctx.kube.clone()),
        };
        controller = controller.owns(jobs, watcher::Config::default().labels(DATASET_LABEL));
    }
    controller
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(reconcile_one, error_policy, ctx)
        .for_each(|r| async move {
            match r {
                Ok((obj, _)) => tracing::debug!(dataset = %obj, "reconciled"),
                Err(e) => tracing::warn!(error = %e, "reconcile failed"),
            }
        })
        .await;
}

/// A mapper for `Controller::watches`: any change looks at every Dataset.
fn every_dataset<T>(
    store: reflector::Store<Dataset>,
) -> impl Fn(T) -> Vec<ObjectRef<Dataset>> + Send + Sync + 'static {
    move |_| {
        store
            .state()
            .iter()
            .map(|d| ObjectRef::from_obj(&**d))
            .collect()
    }
}

fn error_policy(ds: Arc<Dataset>, err: &Error, ctx: Arc<Context>) -> Requeue {
    ctx.stats.reconcile_error(match err {
        Error::Kube(_) => "kube",
        Error::Finalizer(_) => "finalizer",
        Error::NoNamespace => "no_namespace",
        Error::CleanupPending => "cleanup_pending",
        Error::DeleteIngested { .. } => "delete_ingested",
    });
    let namespace = ds.namespace().unwrap_or_default();
    match err {
        Error::CleanupPending => {
            tracing::debug!(%namespace, dataset = %ds.name_any(), "cleanup pending")
        }
        e => tracing::warn!(
            %namespace,
            dataset = %ds.name_any(),
            error = %e,
            "reconcile failed (retried in 1s; check the controller's RBAC and the API server)"
        ),
    }
    Requeue::requeue(Duration::from_secs(1))
}

async fn reconcile_one(ds: Arc<Dataset>, ctx: Arc<Context>) -> Result<Requeue, Error> {
    let ns = ds.namespace().ok_or(Error::NoNamespace)?;
    if !ctx.config.datasets.contains(&ns) {
        // Not ours to obey: not even a finalizer (see the module doc).
        tracing::debug!(namespace = %ns, dataset = %ds.name_any(), "a Dataset outside the controller's namespaces: ignored");
        return Ok(Requeue::await_change());
    }
    ctx.stats.reconcile_begun();
    let api: Api<Dataset> = Api::namespaced(ctx.kube.clone(), &ns);
    finalizer(&api, FINALIZER, ds, |event| async {
        match event {
            Finalize::Apply(ds) => apply(&ctx, &ds).await,
            Finalize::Cleanup(ds) => cleanup(&ctx, &ds).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

async fn apply(ctx: &Context, ds: &Dataset) -> Result<Requeue, Error> {
    let observed = observe(ctx, ds).await?;
    let mut plan = reconcile::reconcile(&observed, &ctx.config.settings);
    carry_out(ctx, ds, &observed, &mut plan).await?;
    let prev = ds.status.as_ref();
    if Some(&plan.status) != prev {
        write_status(ctx, ds, &plan.status).await?;
        let was_failed = prev.is_some_and(|p| {
            p.phase == crate::crd::Phase::Failed && p.reason == plan.status.reason
        });
        if plan.status.phase == crate::crd::Phase::Failed && !was_failed {
            let reason = plan.status.reason.as_deref().unwrap_or_default();
            ctx.stats.turned_failed(reason);
            tracing::warn!(
                namespace = %observed.dataset.namespace,
                dataset = %observed.dataset.name,
                %reason,
                message = plan.status.conditions.iter().find(|c| c.type_ == reconcile::READY).map(|c| c.message.as_str()).unwrap_or_default(),
                "Dataset failed: fix its spec or source (kubectl describe dataset)"
            );
        }
    }
    ctx.stats.dataset(
        &observed.dataset.namespace,
        &observed.dataset.name,
        Some(&plan.status),
    );
    Ok(Requeue::requeue(plan.requeue))
}

async fn cleanup(ctx: &Context, ds: &Dataset) -> Result<Requeue, Error> {
    // A few rounds here: an unseed answers once the agent let go, so the
    // next look usually finds nothing left.
    for _ in 0..3 {
        let observed = observe(ctx, ds).await?;
        let mut plan = reconcile::reconcile(&observed, &ctx.config.settings);
        if plan.actions.contains(&Action::RemoveFinalizer) {
            let id = key_of(ds);
            // An ingest thread told to stop may still be putting: the key
            // is deleted only once it ended (else it could come back).
            if ingest_threads(ctx, &id) > 0 {
                purge_ingest(ctx, &id).await;
                return Err(Error::CleanupPending);
            }
            purge_ingest(ctx, &id).await;
            for action in &plan.actions {
                if let Action::DeleteIngested { key } = action {
                    delete_ingested(ctx, key).await?;
                }
            }
            if let Ok(mut t) = ctx.threads.lock() {
                t.remove(&id);
            }
            let (ns, name) = id;
            ctx.stats.dataset(&ns, &name, None);
            tracing::info!(namespace = %ns, dataset = %name, "Dataset deleted: no node holds or is labelled with it");
            return Ok(Requeue::await_change());
        }
        carry_out(ctx, ds, &observed, &mut plan).await?;
    }
    Err(Error::CleanupPending)
}

fn key_of(ds: &Dataset) -> IngestKey {
    (ds.namespace().unwrap_or_default(), ds.name_any())
}

/// How many ingest threads of the Dataset are still alive.
fn ingest_threads(ctx: &Context, id: &IngestKey) -> usize {
    ctx.threads
        .lock()
        .ok()
        .and_then(|t| t.get(id).map(|a| Arc::strong_count(a) - 1))
        .unwrap_or(0)
}

/// Deletes the key a deleted Dataset's source was ingested into (and any
/// key below it); one already gone is no error.
async fn delete_ingested(ctx: &Context, key: &str) -> Result<(), Error> {
    let failed = |message: String| Error::DeleteIngested {
        key: key.to_owned(),
        message,
    };
    let parsed = Key::parse(key).map_err(|e| failed(e.to_string()))?;
    match ctx.kt.rm(&parsed, true).await {
        Ok(r) => {
            tracing::info!(%key, keys = r.deleted.len(), "deleted the ingested key of a deleted Dataset (reclaimPolicy Delete)");
            Ok(())
        }
        Err(e) if e.code() == Some(ErrorCode::NotFound) => Ok(()),
        Err(e) => Err(failed(e.to_string())),
    }
}

/// Everything the reconcile looks at.
async fn observe(ctx: &Context, ds: &Dataset) -> Result<Observed, Error> {
    let ns = ds.namespace().ok_or(Error::NoNamespace)?;
    let nodes = observe_nodes(ctx).await?;
    let source = observe_source(ctx, ds, &ns).await?;
    Ok(Observed {
        dataset: DatasetView {
            namespace: ns,
            name: ds.name_any(),
            uid: ds.uid().unwrap_or_default(),
            generation: ds.metadata.generation,
            spec: ds.spec.clone(),
            status: ds.status.clone(),
            deleting: ds.metadata.deletion_timestamp.is_some(),
        },
        nodes,
        source,
        now: SystemTime::now(),
    })
}

/// The node-cache pod of each node: its address, and its port when
/// [`NodeCachePods::port_from_pod`] (else the controller's). Labelled pods
/// that are not the DaemonSet's are skipped, with a warning: the token is
/// never sent to them.
fn node_cache_pods(
    pods: &[Pod],
    accept: &NodeCachePods,
) -> BTreeMap<String, (IpAddr, Option<u16>)> {
    let mut out = BTreeMap::new();
    for p in pods {
        let (Some(spec), Some(status)) = (&p.spec, &p.status) else {
            continue;
        };
        if let Some(why) = accept.refuse(p) {
            tracing::warn!(pod = %p.name_any(), reason = %why, "a pod labelled {NODE_CACHE_SELECTOR} is not a node-cache agent: ignored");
            continue;
        }
        let running = status.phase.as_deref() == Some("Running");
        let ready = status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        let ip = status
            .pod_ip
            .as_deref()
            .and_then(|ip| ip.parse::<IpAddr>().ok());
        let (Some(node), Some(ip)) = (&spec.node_name, ip) else {
            continue;
        };
        if !running || !ready || p.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let port = accept
            .port_from_pod
            .then(|| {
                spec.containers
                    .iter()
                    .flat_map(|c| c.ports.iter().flatten())
                    .find(|port| matches!(port.name.as_deref(), Some("node-cache") | Some("http")))
                    .and_then(|port| u16::try_from(port.container_port).ok())
            })
            .flatten();
        out.insert(node.clone(), (ip, port));
    }
    out
}

async fn observe_nodes(ctx: &Context) -> Result<Vec<ObservedNode>, Error> {
    let nodes = Api::<Node>::all(ctx.kube.clone())
        .list(&ListParams::default())
        .await?;
    let pods = Api::<Pod>::namespaced(ctx.kube.clone(), &ctx.config.namespace)
        .list(&ListParams::default().labels(NODE_CACHE_SELECTOR))
        .await?;
    let agents = node_cache_pods(&pods.items, &ctx.config.node_cache_pods);
    let reports = futures::future::join_all(nodes.items.iter().map(|n| {
        let name = n.name_any();
        let agent = agents
            .get(&name)
            .map(|(ip, port)| ctx.caches.at(*ip, *port));
        async move {
            match agent {
                None => Agent::None,
                Some(a) => match a.report().await {
                    Ok(r) => check_report(&name, r),
                    Err(e) => Agent::Unreachable(e.to_string()),
                },
            }
        }
    }))
    .await;
    let count = |f: fn(&Agent) -> bool| reports.iter().filter(|a| f(a)).count();
    ctx.stats.node_caches(
        count(|a| matches!(a, Agent::Reachable(_))),
        count(|a| matches!(a, Agent::Unreachable(_))),
        count(|a| matches!(a, Agent::None)),
    );
    Ok(nodes
        .items
        .into_iter()
        .zip(reports)
        .map(|(n, agent)| {
            let ready = n
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            let unschedulable = n
                .spec
                .as_ref()
                .and_then(|s| s.unschedulable)
                .unwrap_or(false);
            ObservedNode {
                name: n.name_any(),
                labels: n.metadata.labels.clone().unwrap_or_default(),
                ready,
                unschedulable,
                agent,
            }
        })
        .collect())
}

/// The most of an agent's words copied into a status (an error message).
const MAX_AGENT_MESSAGE: usize = 512;

/// An agent that says it serves another node is not this node's. What an
/// agent reports goes into the Dataset's status, so it is bounded first:
/// an entry whose path is not below the agent's root (or absurdly long)
/// or whose version is over 256 bytes is dropped (the node counts as not
/// holding it), an error message is cut to [`MAX_AGENT_MESSAGE`]. (A lying
/// agent can still claim to hold what it does not, for its own node only:
/// see [`crate::reconcile`] on members only a report names.)
fn check_report(node: &str, mut r: NodeReport) -> Agent {
    if r.node == node {
        r.datasets.retain(|d| {
            d.path.len() <= 4096
                && d.version.len() <= 256
                && kt_types::dataset::path_problem(&r.root, &d.path).is_none()
        });
        for d in &mut r.datasets {
            if let Some(e) = &mut d.error
                && e.len() > MAX_AGENT_MESSAGE
            {
                let mut cut = MAX_AGENT_MESSAGE;
                while !e.is_char_boundary(cut) {
                    cut -= 1;
                }
                e.truncate(cut);
            }
        }
        Agent::Reachable(r)
    } else {
        Agent::Unreachable(format!(
            "the node-cache pod on node {node} says it holds data for node {:?}",
            r.node
        ))
    }
}

async fn observe_source(ctx: &Context, ds: &Dataset, ns: &str) -> Result<SourceState, Error> {
    Ok(match &ds.spec.source {
        Source::Key(key) => {
            key_source(
                ctx,
                key,
                ds.spec.refresh.version.as_deref(),
                ds.status.as_ref(),
            )
            .await
        }
        Source::S3(s3) => s3_source(ctx, ds, s3),
        Source::Pvc(pvc) => pvc_source(ctx, ds, ns, pvc).await?,
    })
}

/// A key source: its current version, or the pinned one while the
/// Dataset already places it.
async fn key_source(
    ctx: &Context,
    raw: &str,
    pinned: Option<&str>,
    status: Option<&DatasetStatus>,
) -> SourceState {
    let key = match Key::parse(raw) {
        Ok(k) => k,
        Err(e) => {
            return SourceState::Invalid {
                reason: "InvalidKey".into(),
                message: format!("source.key {raw:?}: {e}"),
            };
        }
    };
    match ctx.kt.stat(&key).await {
        Ok(rec) if rec.tensors.is_some() => SourceState::Invalid {
            reason: "NotFilesystemData".into(),
            message: format!("key {key} holds GPU data: a dataset is files"),
        },
        Ok(rec) => match pinned {
            Some(pin) if pin != rec.version => {
                let placed = status.and_then(|s| {
                    (s.version.as_deref() == Some(pin))
                        .then_some(s.bytes)
                        .flatten()
                });
                match placed {
                    Some(bytes) => SourceState::Key {
                        key: key.to_string(),
                        version: pin.to_owned(),
                        bytes,
                    },
                    None => SourceState::NotFound(format!(
                        "version {pin} of key {key} is not there (its current version is {})",
                        rec.version
                    )),
                }
            }
            _ => SourceState::Key {
                key: key.to_string(),
                version: rec.version,
                bytes: rec.size,
            },
        },
        Err(e) => match e.code() {
            Some(ErrorCode::NotFound) => SourceState::NotFound(format!("key {key} not found")),
            Some(ErrorCode::InvalidKey) => SourceState::Invalid {
                reason: "InvalidKey".into(),
                message: e.to_string(),
            },
            Some(ErrorCode::Forbidden | ErrorCode::Unauthorized) => SourceState::Invalid {
                reason: "KeyForbidden".into(),
                message: format!("reading key {key}: {e}"),
            },
            _ => SourceState::Unavailable(format!("asking for key {key}: {e}")),
        },
    }
}

/// An S3 source's ingest: the state of this process's ingest task of the
/// Dataset (none yet: not started).
fn s3_source(ctx: &Context, ds: &Dataset, _s3: &S3Source) -> SourceState {
    let state = ctx
        .ingests
        .lock()
        .ok()
        .and_then(|m| m.get(&key_of(ds)).map(|i| i.state.clone()));
    SourceState::Ingest(state.unwrap_or(IngestState::NotStarted))
}

/// The credentials of an S3 source, from its Secret.
async fn s3_credentials(
    ctx: &Context,
    ns: &str,
    s3: &S3Source,
) -> Result<Option<S3Credentials>, String> {
    let Some(name) = &s3.credentials_secret else {
        return Ok(None);
    };
    let secrets: Api<Secret> = Api::namespaced(ctx.kube.clone(), ns);
    let secret = secrets
        .get_opt(name)
        .await
        .map_err(|e| format!("reading Secret {ns}/{name}: {e}"))?
        .ok_or_else(|| format!("Secret {ns}/{name} (credentialsSecret) not found"))?;
    let data = secret.data.unwrap_or_default();
    let field = |k: &str| {
        data.get(k)
            .map(|v| String::from_utf8_lossy(&v.0).trim().to_owned())
    };
    match (field("AWS_ACCESS_KEY_ID"), field("AWS_SECRET_ACCESS_KEY")) {
        (Some(access_key_id), Some(secret_access_key)) => Ok(Some(S3Credentials {
            access_key_id,
            secret_access_key,
            session_token: field("AWS_SESSION_TOKEN"),
        })),
        _ => Err(format!(
            "Secret {ns}/{name} lacks AWS_ACCESS_KEY_ID or AWS_SECRET_ACCESS_KEY"
        )),
    }
}

/// Starts the ingest of an S3 source in the background (replacing one that
/// ran before); its progress and outcome land in the context's ingests.
async fn start_s3_ingest(ctx: &Context, ds: &Dataset, s3: &S3Source) -> Result<(), Error> {
    let ns = ds.namespace().ok_or(Error::NoNamespace)?;
    let name = ds.name_any();
    let id = key_of(ds);
    let source = ds.spec.source.clone();
    let credentials = match s3_credentials(ctx, &ns, s3).await {
        Ok(c) => c,
        Err(message) => {
            set_ingest(
                &ctx.ingests,
                &id,
                IngestState::Failed {
                    source,
                    reason: "CredentialsNotFound".into(),
                    message,
                    at: SystemTime::now(),
                },
                None,
            );
            return Ok(());
        }
    };
    let cfg = S3Config::from_source(s3, credentials);
    let key = match Key::parse(&ingest_key(&ns, &name)) {
        Ok(k) => k,
        Err(e) => {
            set_ingest(
                &ctx.ingests,
                &id,
                IngestState::Failed {
                    source,
                    reason: "InvalidName".into(),
                    message: format!("the Dataset's key: {e}"),
                    at: SystemTime::now(),
                },
                None,
            );
            return Ok(());
        }
    };
    let staging = ctx.config.staging_dir.join(&ns).join(&name);
    let ingests = ctx.ingests.clone();
    let kt = ctx.kt.clone();
    let progress: OnProgress = {
        let ingests = ingests.clone();
        let id = id.clone();
        Arc::new(move |e: &IngestEvent| {
            let Ok(mut m) = ingests.lock() else { return };
            let Some(IngestTask {
                state: IngestState::Running { progress },
                ..
            }) = m.get_mut(&id)
            else {
                return;
            };
            match e {
                IngestEvent::Planned {
                    objects,
                    bytes,
                    remove,
                    ..
                } => {
                    progress.objects = *objects;
                    progress.bytes = *bytes;
                    progress.removed = *remove;
                }
                IngestEvent::Fetched { .. } => progress.changed += 1,
                IngestEvent::Putting => {}
            }
        })
    };
    // The ingest's future is not `Send` (object_store's listing stream
    // borrows across awaits), so it runs on a runtime of its own, in its
    // own thread; cancelling the token stops it.
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    let purge = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let purged = purge.clone();
    // Held by the thread until it ends (see `IngestThreads`).
    let alive = match ctx.threads.lock() {
        Ok(mut t) => Some(t.entry(id.clone()).or_default().clone()),
        Err(_) => None,
    };
    set_ingest(
        &ingests,
        &id,
        IngestState::Running {
            progress: IngestStatus::default(),
        },
        Some(cancel),
    );
    if let Ok(mut m) = ingests.lock()
        && let Some(t) = m.get_mut(&id)
    {
        t.purge = purge;
    }
    let thread = std::thread::Builder::new()
        .name(format!("ingest-{ns}-{name}"))
        .spawn(move || {
            let _alive = alive;
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    finish_ingest(
                        &ingests,
                        &id,
                        IngestState::Failed {
                            source,
                            reason: "IngestFailed".into(),
                            message: format!("no runtime for the ingest: {e}"),
                            at: SystemTime::now(),
                        },
                    );
                    return;
                }
            };
            if let Err(e) = std::fs::create_dir_all(&staging) {
                tracing::warn!(dir = %staging.display(), error = %e, "no staging directory");
            }
            let outcome = rt.block_on(async {
                tokio::select! {
                    r = ingest::ingest(&kt, &key, &cfg, &staging, Some(progress)) => Some(r),
                    () = stop.cancelled() => None,
                }
            });
            // The Dataset went meanwhile (even if the ingest just ended).
            if purged.load(std::sync::atomic::Ordering::SeqCst) {
                remove_staging(&staging);
                return;
            }
            let state = match outcome {
                None => return,
                Some(Ok(report)) => IngestState::Done {
                    source,
                    key: key.to_string(),
                    version: report.version,
                    bytes: report.bytes,
                    status: report.status,
                    finished: SystemTime::now(),
                },
                Some(Err(e)) => IngestState::Failed {
                    source,
                    reason: ingest_failure_reason(&e).into(),
                    message: e.to_string(),
                    at: SystemTime::now(),
                },
            };
            finish_ingest(&ingests, &id, state);
        });
    if let Err(e) = thread {
        tracing::warn!(dataset = %name, error = %e, "no ingest thread");
    }
    Ok(())
}

/// The reason an ingest failed with: the source's fault, or the kt store
/// away ([`reconcile::SOURCE_UNAVAILABLE`]: retried soon, no Failed phase).
fn ingest_failure_reason(e: &IngestError) -> &'static str {
    match e {
        IngestError::Config(_) | IngestError::Plan(_) | IngestError::BadName { .. } => {
            "InvalidSource"
        }
        IngestError::Put { error, .. }
            if error.is_transient() || error.code() == Some(ErrorCode::Unavailable) =>
        {
            reconcile::SOURCE_UNAVAILABLE
        }
        _ => "IngestFailed",
    }
}

/// Records an ingest's outcome (unless it was replaced or stopped since).
fn finish_ingest(ingests: &Ingests, id: &IngestKey, state: IngestState) {
    if let Ok(mut m) = ingests.lock()
        && let Some(t) = m.get_mut(id)
        && t.task.as_ref().is_some_and(|c| !c.is_cancelled())
    {
        t.state = state;
        t.task = None;
    }
}

fn set_ingest(
    ingests: &Ingests,
    id: &IngestKey,
    state: IngestState,
    task: Option<CancellationToken>,
) {
    if let Ok(mut m) = ingests.lock() {
        let old = m.insert(
            id.clone(),
            IngestTask {
                state,
                task,
                purge: Arc::default(),
            },
        );
        if let Some(t) = old.and_then(|o| o.task) {
            t.cancel();
        }
    }
}

fn stop_ingest(ingests: &Ingests, id: &IngestKey) {
    if let Ok(mut m) = ingests.lock()
        && let Some(t) = m.remove(id).and_then(|o| o.task)
    {
        t.cancel();
    }
}

/// The Dataset is gone: its ingest stops and its staging directory (a
/// whole copy of an S3 source) is removed — now when no ingest runs, else
/// by the ingest's thread once it stopped.
async fn purge_ingest(ctx: &Context, id: &IngestKey) {
    let running = match ctx.ingests.lock() {
        Ok(mut m) => m.remove(id).and_then(|t| {
            let c = t.task?;
            t.purge.store(true, std::sync::atomic::Ordering::SeqCst);
            c.cancel();
            Some(())
        }),
        Err(_) => None,
    };
    if running.is_none() {
        let staging = ctx.config.staging_dir.join(&id.0).join(&id.1);
        let _ = kt_sync::task::spawn(move || remove_staging(&staging)).await;
    }
}

fn remove_staging(dir: &std::path::Path) {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {
            tracing::info!(dir = %dir.display(), "removed a deleted Dataset's staging directory")
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove a deleted Dataset's staging directory")
        }
    }
}

/// The Job that puts a PVC source's directory into the store.
fn job_name(ds: &Dataset) -> String {
    format!("ktds-ingest-{}", ds.uid().unwrap_or_else(|| ds.name_any()))
}

/// A PVC source: the state of its Job.
async fn pvc_source(
    ctx: &Context,
    ds: &Dataset,
    ns: &str,
    pvc: &PvcSource,
) -> Result<SourceState, Error> {
    if ctx.config.pvc.is_none() {
        return Ok(SourceState::Invalid {
            reason: "Unsupported".into(),
            message: "PVC sources need the controller's --ingest-image (the image with `kt`)"
                .into(),
        });
    }
    if let Some(p) = &pvc.path
        && let Some(m) = pvc_path_problem(p)
    {
        return Ok(SourceState::Invalid {
            reason: "InvalidPath".into(),
            message: format!("source.pvc.path: {m}"),
        });
    }
    let jobs: Api<Job> = Api::namespaced(ctx.kube.clone(), ns);
    let Some(job) = jobs.get_opt(&job_name(ds)).await? else {
        return Ok(SourceState::Ingest(IngestState::NotStarted));
    };
    let source: Source = job
        .annotations()
        .get(SOURCE_ANNOTATION)
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_else(|| ds.spec.source.clone());
    let status = job.status.clone().unwrap_or_default();
    let condition = |t: &str| {
        status
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == t && c.status == "True")
            .cloned()
    };
    let at = |c: &k8s_openapi::api::batch::v1::JobCondition| {
        c.last_transition_time
            .as_ref()
            .map(|t| SystemTime::UNIX_EPOCH + Duration::from_secs(t.0.as_second().max(0) as u64))
            .unwrap_or_else(SystemTime::now)
    };
    if let Some(c) = condition("Failed") {
        return Ok(SourceState::Ingest(IngestState::Failed {
            source,
            reason: "IngestFailed".into(),
            message: format!(
                "the ingest Job {} failed: {}",
                job.name_any(),
                c.message
                    .as_deref()
                    .or(c.reason.as_deref())
                    .unwrap_or("no reason given")
            ),
            at: at(&c),
        }));
    }
    let Some(done) = condition("Complete") else {
        return Ok(SourceState::Ingest(IngestState::Running {
            progress: IngestStatus::default(),
        }));
    };
    let key = ingest_key(ns, &ds.name_any());
    Ok(match key_source(ctx, &key, None, None).await {
        SourceState::Key {
            key,
            version,
            bytes,
        } => SourceState::Ingest(IngestState::Done {
            source,
            key,
            version,
            bytes,
            status: IngestStatus {
                bytes,
                last_listed: Some(humantime::format_rfc3339_seconds(at(&done)).to_string()),
                ..IngestStatus::default()
            },
            finished: at(&done),
        }),
        other => other,
    })
}

fn pvc_path_problem(p: &str) -> Option<String> {
    let bad = p.split('/').any(|s| s == ".." || s == ".") || p.contains('\0');
    bad.then(|| format!("{p:?} has a `.` or `..` segment"))
}

/// The Job that puts `pvc` into the Dataset's key.
pub fn pvc_job(ds: &Dataset, pvc: &PvcSource, cfg: &PvcIngest) -> Job {
    let ns = ds.namespace().unwrap_or_default();
    let key = ingest_key(&ns, &ds.name_any());
    let src = format!(
        "/source/{}",
        pvc.path.as_deref().unwrap_or("").trim_start_matches('/')
    );
    let owner = ds.controller_owner_ref(&());
    let source = serde_json::to_string(&ds.spec.source).unwrap_or_default();
    // Its kt token: the ServiceAccount's projected token (kube identities),
    // else the static token's Secret. Either is mounted at /etc/kt/token.
    let token = match &cfg.service_account {
        Some(_) => serde_json::json!({
            "name": "token",
            "projected": {
                "defaultMode": 0o440,
                "sources": [{ "serviceAccountToken": {
                    "audience": kt_kube::review::AUDIENCE,
                    "expirationSeconds": 3600,
                    "path": "token",
                } }],
            },
        }),
        None => serde_json::json!({
            "name": "token",
            "secret": { "secretName": cfg.token_secret, "items": [{ "key": "token", "path": "token" }] },
        }),
    };
    let job = serde_json::json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(ds),
            "namespace": ns,
            "labels": {
                DATASET_LABEL: ds.name_any(),
                "app.kubernetes.io/managed-by": FIELD_MANAGER,
            },
            "annotations": { SOURCE_ANNOTATION: source },
            "ownerReferences": owner.into_iter().collect::<Vec<_>>(),
        },
        "spec": {
            "backoffLimit": 2,
            "template": {
                "metadata": { "labels": { DATASET_LABEL: ds.name_any() } },
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": cfg.service_account,
                    // No token for the API server: it talks to kt only.
                    "automountServiceAccountToken": false,
                    // No <SERVICE>_PORT variables: a Service named like a kt
                    // variable (kt-relay: KT_RELAY_PORT) would set it for kt.
                    "enableServiceLinks": false,
                    "securityContext": {
                        "runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
                        "seccompProfile": { "type": "RuntimeDefault" },
                    },
                    "containers": [{
                        "name": "put",
                        "image": cfg.image,
                        "args": ["put", key, "--src", src, "--lifespan", "cluster"],
                        "env": [
                            { "name": kt_types::env::METADATA_URL, "value": cfg.metadata_url },
                            { "name": kt_types::env::TOKEN_FILE, "value": "/etc/kt/token/token" },
                            { "name": "HOME", "value": "/tmp" },
                        ],
                        "securityContext": {
                            "allowPrivilegeEscalation": false,
                            "readOnlyRootFilesystem": true,
                            "capabilities": { "drop": ["ALL"] },
                        },
                        "volumeMounts": [
                            { "name": "source", "mountPath": "/source", "readOnly": true },
                            { "name": "token", "mountPath": "/etc/kt/token", "readOnly": true },
                            { "name": "tmp", "mountPath": "/tmp" },
                        ],
                    }],
                    "volumes": [
                        { "name": "source", "persistentVolumeClaim": { "claimName": pvc.claim_name, "readOnly": true } },
                        token,
                        { "name": "tmp", "emptyDir": {} },
                    ],
                },
            },
        },
    });
    serde_json::from_value(job).unwrap_or_default()
}

/// Deletes a PVC source's running ingest Job, its pods first (foreground:
/// the Job is there until they are gone, so the source reads as running
/// until no pod can put the key any more).
async fn stop_pvc_ingest(ctx: &Context, ds: &Dataset) -> Result<(), Error> {
    let ns = ds.namespace().ok_or(Error::NoNamespace)?;
    let jobs: Api<Job> = Api::namespaced(ctx.kube.clone(), &ns);
    match jobs
        .delete(&job_name(ds), &DeleteParams::foreground())
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn start_ingest(ctx: &Context, ds: &Dataset) -> Result<(), Error> {
    match &ds.spec.source {
        Source::S3(s3) => start_s3_ingest(ctx, ds, s3).await?,
        Source::Pvc(pvc) => {
            let Some(cfg) = &ctx.config.pvc else {
                return Ok(());
            };
            let ns = ds.namespace().ok_or(Error::NoNamespace)?;
            let jobs: Api<Job> = Api::namespaced(ctx.kube.clone(), &ns);
            let name = job_name(ds);
            if jobs.get_opt(&name).await?.is_some() {
                let dp = DeleteParams::background();
                jobs.delete(&name, &dp).await?;
            }
            jobs.create(&PostParams::default(), &pvc_job(ds, pvc, cfg))
                .await?;
        }
        Source::Key(_) => {}
    }
    Ok(())
}

/// Carries out the plan's actions (not the finalizer's removal, which the
/// `finalizer` helper does). A seed an agent refuses marks its node Failed
/// in the plan's status.
async fn carry_out(
    ctx: &Context,
    ds: &Dataset,
    observed: &Observed,
    plan: &mut Plan,
) -> Result<(), Error> {
    let ns = &observed.dataset.namespace;
    let name = &observed.dataset.name;
    let pods = Api::<Pod>::namespaced(ctx.kube.clone(), &ctx.config.namespace)
        .list(&ListParams::default().labels(NODE_CACHE_SELECTOR))
        .await?;
    let agents = node_cache_pods(&pods.items, &ctx.config.node_cache_pods);
    let agent = |node: &str| agents.get(node).map(|(ip, port)| ctx.caches.at(*ip, *port));
    let nodes: Api<Node> = Api::all(ctx.kube.clone());
    let label = kt_types::dataset::node_label(ns, name);
    let reference = ds.object_ref(&());
    // Seeds go out together (one broadcast group joins at once).
    let seeds = plan.actions.iter().filter_map(|a| match a {
        Action::Seed { node, request } => Some((node.clone(), request.clone())),
        _ => None,
    });
    let seeded = futures::future::join_all(seeds.map(|(node, request)| {
        let a = agent(&node);
        ctx.stats.seed_sent(request.broadcast.is_some());
        async move {
            let r = match a {
                Some(a) => a
                    .seed(ns, name, &request)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string()),
                None => Err("no node-cache agent on the node".to_owned()),
            };
            (node, r)
        }
    }))
    .await;
    for (node, r) in seeded {
        if let Err(e) = r {
            ctx.stats.seed_refused();
            tracing::warn!(namespace = %ns, dataset = %name, node = %node, error = %e, "seed refused: the node is marked Failed and another one chosen");
            if let Some(n) = plan.status.nodes.iter_mut().find(|n| n.name == node) {
                n.state = NodeState::Failed;
                n.message = Some(format!("seed refused: {e}"));
            }
        }
    }
    for action in &plan.actions {
        match action {
            // The last plan of a deleted Dataset: `cleanup` does them, in
            // order, once no ingest runs.
            Action::Seed { .. } | Action::DeleteIngested { .. } | Action::RemoveFinalizer => {}
            Action::Ingest => {
                ctx.stats.ingest_started();
                start_ingest(ctx, ds).await?
            }
            Action::StopIngest => match &ds.spec.source {
                Source::Pvc(_) => stop_pvc_ingest(ctx, ds).await?,
                _ => stop_ingest(&ctx.ingests, &key_of(ds)),
            },
            Action::Unseed { node, retain } => {
                ctx.stats.unseed_sent();
                if let Some(a) = agent(node)
                    && let Err(e) = a.unseed(ns, name, *retain).await
                {
                    tracing::warn!(namespace = %ns, dataset = %name, node = %node, error = %e, "unseed failed (tried again next reconcile)");
                }
            }
            Action::Label { node, value } => {
                let patch = serde_json::json!({ "metadata": { "labels": { &label: value } } });
                nodes
                    .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
            }
            Action::Unlabel { node } => {
                let patch = serde_json::json!({ "metadata": { "labels": { &label: null } } });
                match nodes
                    .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    other => {
                        other?;
                    }
                }
            }
            Action::Event(e) => {
                let ev = KubeEvent {
                    type_: match e.type_ {
                        EventType::Normal => KubeEventType::Normal,
                        EventType::Warning => KubeEventType::Warning,
                    },
                    reason: e.reason.clone(),
                    note: Some(e.message.chars().take(1000).collect()),
                    action: "Reconcile".into(),
                    secondary: None,
                };
                if let Err(err) = ctx.recorder.publish(&ev, &reference).await {
                    tracing::warn!(namespace = %ns, dataset = %name, error = %err, reason = %e.reason, "event not recorded");
                }
            }
        }
    }
    Ok(())
}

async fn write_status(ctx: &Context, ds: &Dataset, status: &DatasetStatus) -> Result<(), Error> {
    let ns = ds.namespace().ok_or(Error::NoNamespace)?;
    let api: Api<Dataset> = Api::namespaced(ctx.kube.clone(), &ns);
    let patch = serde_json::json!({
        "apiVersion": "kt.dev/v1alpha1",
        "kind": "Dataset",
        "status": status,
    });
    api.patch_status(
        &ds.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::DatasetSpec;

    /// A Running, Ready node-cache pod on `node` at `ip`, its port 9999,
    /// with `owner` (kind/name, as its controller) and `account`.
    fn cache_pod(
        name: &str,
        node: &str,
        ip: &str,
        owner: Option<(&str, &str)>,
        account: Option<&str>,
    ) -> Pod {
        let owners: Vec<serde_json::Value> = owner
            .map(|(kind, owner)| {
                serde_json::json!({
                    "apiVersion": "apps/v1", "kind": kind, "name": owner,
                    "uid": "u-ds", "controller": true,
                })
            })
            .into_iter()
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name, "namespace": "kt",
                "labels": { "app.kubernetes.io/component": "node-cache" },
                "ownerReferences": owners,
            },
            "spec": {
                "nodeName": node,
                "serviceAccountName": account,
                "containers": [{
                    "name": "agent",
                    "ports": [{ "name": "http", "containerPort": 9999 }],
                }],
            },
            "status": {
                "phase": "Running", "podIP": ip,
                "conditions": [{ "type": "Ready", "status": "True" }],
            },
        }))
        .unwrap()
    }

    /// The controller's token goes only to the DaemonSet's pods, at the
    /// controller's port: a pod that merely carries the label, or names
    /// the DaemonSet but runs as another account, is no agent.
    #[test]
    fn only_the_daemonsets_pods_are_node_cache_agents() {
        let ds = Some(("DaemonSet", "kt-node-cache"));
        let sa = Some("kt-node-cache");
        let pods = [
            cache_pod("kt-node-cache-a", "n1", "10.0.0.1", ds, sa),
            // Listed after the real one: the last pod of a node won.
            cache_pod("zz-evil", "n1", "10.0.0.66", None, sa),
            cache_pod("zz-evil-2", "n2", "10.0.0.67", ds, Some("default")),
            cache_pod("zz-evil-3", "n3", "10.0.0.68", ds, None),
            cache_pod(
                "zz-evil-4",
                "n4",
                "10.0.0.69",
                Some(("DaemonSet", "copy")),
                sa,
            ),
            cache_pod(
                "zz-evil-5",
                "n5",
                "10.0.0.70",
                Some(("ReplicaSet", "kt-node-cache")),
                sa,
            ),
        ];
        let accept = NodeCachePods::default();
        let agents = node_cache_pods(&pods, &accept);
        assert_eq!(
            agents,
            BTreeMap::from([("n1".to_owned(), ("10.0.0.1".parse().unwrap(), None))]),
            "only the DaemonSet's pod, on the controller's port"
        );
        // A testbed's agents on ports of their own.
        let testbed = NodeCachePods {
            port_from_pod: true,
            ..NodeCachePods::default()
        };
        assert_eq!(
            node_cache_pods(&pods, &testbed).get("n1"),
            Some(&("10.0.0.1".parse().unwrap(), Some(9999)))
        );
    }

    #[test]
    fn a_pvc_job_runs_kt_put_with_the_claim_read_only() {
        let mut ds = Dataset::new(
            "imagenet",
            crate::crd::from_yaml::<DatasetSpec>(
                "source: { pvc: { claimName: data, path: train } }",
            )
            .unwrap(),
        );
        ds.metadata.namespace = Some("team".into());
        ds.metadata.uid = Some("u-1".into());
        let Source::Pvc(pvc) = ds.spec.source.clone() else {
            unreachable!()
        };
        let cfg = PvcIngest {
            image: "kt-client:dev".into(),
            metadata_url: "http://kt-metadata:8081".into(),
            token_secret: "kt-token".into(),
            service_account: None,
        };
        let job = pvc_job(&ds, &pvc, &cfg);
        assert_eq!(job.metadata.name.as_deref(), Some("ktds-ingest-u-1"));
        let pod = job.spec.unwrap().template.spec.unwrap();
        let c = &pod.containers[0];
        assert_eq!(
            c.args.as_deref().unwrap(),
            [
                "put",
                "datasets/team/imagenet",
                "--src",
                "/source/train",
                "--lifespan",
                "cluster"
            ]
        );
        let source = pod
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == "source")
            .unwrap();
        let claim = source.persistent_volume_claim.unwrap();
        assert_eq!(claim.claim_name, "data");
        assert_eq!(claim.read_only, Some(true));
        assert!(
            c.volume_mounts
                .iter()
                .flatten()
                .any(|m| m.mount_path == "/source" && m.read_only == Some(true))
        );
        assert_eq!(job.metadata.owner_references.unwrap()[0].name, "imagenet");
    }

    /// The Job's kt token: the static token's Secret, or (kube identities)
    /// the ServiceAccount's projected token for kt, never both, at the
    /// file KT_TOKEN_FILE names; no API server token either way.
    #[test]
    fn a_pvc_job_presents_the_secret_or_its_service_accounts_token() {
        let mut ds = Dataset::new(
            "imagenet",
            crate::crd::from_yaml::<DatasetSpec>("source: { pvc: { claimName: data } }").unwrap(),
        );
        ds.metadata.namespace = Some("kt".into());
        ds.metadata.uid = Some("u-2".into());
        let Source::Pvc(pvc) = ds.spec.source.clone() else {
            unreachable!()
        };
        let mut cfg = PvcIngest {
            image: "kt-client:dev".into(),
            metadata_url: "http://kt-metadata:8081".into(),
            token_secret: "kt-token".into(),
            service_account: None,
        };
        let pod_of = |cfg: &PvcIngest| pvc_job(&ds, &pvc, cfg).spec.unwrap().template.spec.unwrap();
        let token_volume = |pod: &k8s_openapi::api::core::v1::PodSpec| {
            let c = &pod.containers[0];
            let env = c.env.iter().flatten();
            let file = env
                .clone()
                .find(|e| e.name == kt_types::env::TOKEN_FILE)
                .and_then(|e| e.value.clone())
                .unwrap();
            let mount = c
                .volume_mounts
                .iter()
                .flatten()
                .find(|m| file.starts_with(&format!("{}/", m.mount_path)))
                .unwrap();
            assert_eq!(mount.read_only, Some(true));
            assert_eq!(file, format!("{}/token", mount.mount_path));
            pod.volumes
                .iter()
                .flatten()
                .find(|v| v.name == mount.name)
                .cloned()
                .unwrap()
        };

        let pod = pod_of(&cfg);
        assert_eq!(pod.service_account_name, None);
        assert_eq!(pod.automount_service_account_token, Some(false));
        let v = token_volume(&pod);
        assert!(v.projected.is_none());
        let secret = v.secret.unwrap();
        assert_eq!(secret.secret_name.as_deref(), Some("kt-token"));
        assert_eq!(secret.items.unwrap()[0].path, "token");

        cfg.service_account = Some("kt-dataset-ingest".into());
        let pod = pod_of(&cfg);
        assert_eq!(
            pod.service_account_name.as_deref(),
            Some("kt-dataset-ingest")
        );
        assert_eq!(pod.automount_service_account_token, Some(false));
        let v = token_volume(&pod);
        assert!(v.secret.is_none(), "no Secret with kube identities");
        let sources = v.projected.unwrap().sources.unwrap();
        assert_eq!(sources.len(), 1);
        let t = sources[0].service_account_token.clone().unwrap();
        assert_eq!(t.audience.as_deref(), Some("kt"));
        assert_eq!(t.expiration_seconds, Some(3600));
        assert_eq!(t.path, "token");
        assert!(
            !serde_json::to_string(&pod).unwrap().contains("kt-token"),
            "the static token's Secret is not named"
        );
    }

    #[test]
    fn agent_reports_are_bounded_before_they_reach_a_status() {
        use kt_types::dataset::{NodeDataset, NodeDatasetState};
        let d = |path: &str, version: &str, error: Option<String>| NodeDataset {
            namespace: "team".into(),
            name: "ds".into(),
            key: "team/ds".into(),
            version: version.into(),
            path: path.into(),
            state: NodeDatasetState::Failed,
            bytes: 0,
            bytes_total: 0,
            placed: true,
            error,
        };
        let report = NodeReport {
            node: "n1".into(),
            root: "/var/lib/kt/datasets".into(),
            budget_bytes: 1,
            used_bytes: 0,
            free_bytes: u64::MAX,
            datasets: vec![
                d("/var/lib/kt/datasets/team/ds", "v1", Some("é".repeat(5000))),
                d("/etc", "v1", None),
                d("/var/lib/kt/datasets/x", &"v".repeat(300), None),
            ],
        };
        let Agent::Reachable(r) = check_report("n1", report.clone()) else {
            panic!("its own node's report")
        };
        assert_eq!(r.datasets.len(), 1);
        let e = r.datasets[0].error.as_deref().unwrap();
        assert!(e.len() <= MAX_AGENT_MESSAGE && e.starts_with('é'));
        assert!(matches!(check_report("n2", report), Agent::Unreachable(_)));
    }

    #[test]
    fn datasets_are_obeyed_only_in_the_namespaces_named() {
        let own = Namespaces::own("kt");
        assert!(own.contains("kt") && !own.contains("team"));
        assert_eq!(own.single(), Some("kt"));
        assert!(Namespaces::All.contains("anything"));
        assert_eq!(Namespaces::All.single(), None);
        let two = Namespaces::parse("kt,team").unwrap();
        assert_eq!(two.single(), None);
        assert!(two.contains("team"));
    }

    #[test]
    fn pvc_paths_may_not_climb() {
        assert!(pvc_path_problem("train/../..").is_some());
        assert!(pvc_path_problem("train/2024").is_none());
    }
}
