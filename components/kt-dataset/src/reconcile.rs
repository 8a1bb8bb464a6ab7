//! One reconcile of a Dataset as a pure function: what the controller saw
//! ([`Observed`]: the Dataset, the nodes and their node-cache agents, the
//! source as resolved, `now`) in, a [`Plan`] out (the [`Action`]s to take,
//! the new [`DatasetStatus`], when to look again). No I/O, no clock, no
//! randomness: the same input gives the same plan, so every rule is a unit
//! test ([`crate::controller`] gathers the input and carries the plan out).
//!
//! The rules:
//!
//! - **Source.** A key source is used as resolved (its latest or pinned
//!   version). An S3 or PVC source is ingested into the store first
//!   ([`Action::Ingest`] when none ran for the current source, when the
//!   refresh interval is over, or a failed one's back-off is). A bad source
//!   (the key is not there, an invalid path, an ingest that failed) ends
//!   `Failed` with the reason in status and one Warning event, and is looked
//!   at again only after [`Settings::failed_requeue`]: no retry storm. A
//!   source that cannot be asked now (the metadata server away: a key's
//!   stat, or an ingest's put failing with [`SOURCE_UNAVAILABLE`]) is no
//!   failure: the nodes keep what they hold, Ready stays Ready, the
//!   `SourceReady` condition says why, and it is asked again soon.
//! - **Placement members** are the nodes the previous status lists as
//!   `Seeding` or `Ready`, and any node whose agent reports the dataset
//!   placed (a status write that was lost) unless the status says it was
//!   being removed, lost or failed. A member whose Node is gone or NotReady,
//!   or whose agent has gone or is unreachable, is `Lost`; one whose seed
//!   failed is `Failed`; both leave the placement and are replaced.
//! - **Candidates** are Ready, schedulable nodes matching `nodeSelector` and
//!   `matchExpressions` whose agent is reachable, accepts the path, and has
//!   `free_bytes` for the version (unless it holds or fetches it already).
//!   They are preferred holding the version, then holding an older one, then
//!   not having failed it, then by most free bytes, then by name.
//! - **Seeding.** When no member holds or fetches the version yet (a first
//!   seeding, or a new version) every node to seed gets the same broadcast
//!   group (`fanout: 1`: a chain, one copy out of the store); nodes added
//!   later get an ordinary get.
//! - **Labels** (`data.kt.dev/<ns>.<name>` = version) are set on members
//!   whose agent holds a version Ready, kept on members fetching a newer one
//!   (labels move only once the node holds it), removed everywhere else.
//! - **Too many members** (scale down, a selector change, an agent
//!   claiming a dataset it was never given): the extra ones (those only a
//!   report names first, then not Ready ones, then by name from the end)
//!   are unlabelled and unseeded
//!   (`retain` per `reclaimPolicy`), `Removing` until their agent lets go.
//! - **Names**: a Dataset whose node label key (`data.kt.dev/<ns>.<name>`)
//!   would be longer than a label key may be fails with `InvalidName`.
//! - **Deletion**: stop a running ingest, unlabel and unseed every node,
//!   then remove the finalizer (agents that cannot be reached do not hold it
//!   up). With `reclaimPolicy: Delete`, the key an S3 or PVC source was
//!   ingested into (`datasets/<ns>/<name>`, the controller's own) is
//!   deleted right before the finalizer ([`Action::DeleteIngested`]), once
//!   no ingest runs (one still running could put it back); with `Retain` it
//!   stays, and a key source (the user's) is never deleted.
//! - **Conditions** `SourceReady`, `Placed`, `Ready` keep their
//!   `lastTransitionTime` while their status does not change; events are
//!   emitted on changes only (of phase and reason, of a node's state).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use kt_types::dataset::{
    NodeDataset, NodeDatasetState, NodeReport, SeedBroadcast, SeedRequest, default_path,
    node_label, path_problem,
};

use crate::crd::{
    Condition, DatasetSpec, DatasetStatus, IngestStatus, NodeSelectorRequirement, NodeState,
    NodeStatus, Phase, ReclaimPolicy, SelectorOperator, Source,
};

/// The condition types.
pub const SOURCE_READY: &str = "SourceReady";
pub const PLACED: &str = "Placed";
pub const READY: &str = "Ready";

/// The reason of an ingest that failed because the kt store could not be
/// reached (the metadata server or store away): not the source's fault.
pub const SOURCE_UNAVAILABLE: &str = "SourceUnavailable";

/// How soon an ingest that failed with [`SOURCE_UNAVAILABLE`] is tried
/// again (at most [`Settings::failed_requeue`]).
pub const UNAVAILABLE_RETRY: Duration = Duration::from_secs(15);

/// How often a key source is looked at when `refresh.interval` is unset.
pub const DEFAULT_KEY_REFRESH: Duration = Duration::from_secs(60);

/// The Dataset as the reconcile sees it.
#[derive(Debug, Clone)]
pub struct DatasetView {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub generation: Option<i64>,
    pub spec: DatasetSpec,
    /// The status written last time (`None`: never).
    pub status: Option<DatasetStatus>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
}

/// A Node and the node-cache agent on it.
#[derive(Debug, Clone)]
pub struct ObservedNode {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Its `Ready` condition is `True`.
    pub ready: bool,
    /// `spec.unschedulable` (cordoned).
    pub unschedulable: bool,
    pub agent: Agent,
}

/// The node-cache agent of a node.
#[derive(Debug, Clone)]
pub enum Agent {
    /// No Running, Ready node-cache pod on the node.
    None,
    /// Its pod is there but `GET /api/v1/datasets` failed (why).
    Unreachable(String),
    /// What it reported.
    Reachable(NodeReport),
}

/// The source, as the controller resolved it.
#[derive(Debug, Clone)]
pub enum SourceState {
    /// A key source: this version (the latest, or the pinned one) of `key`.
    Key {
        key: String,
        version: String,
        bytes: u64,
    },
    /// The key (or its pinned version) is not there.
    NotFound(String),
    /// The source cannot work as written: a reason and a message.
    Invalid { reason: String, message: String },
    /// The source could not be asked now (the metadata server is away): a
    /// transient state, looked at again soon.
    Unavailable(String),
    /// An S3 or PVC source, put into the store by an ingest.
    Ingest(IngestState),
}

/// The ingest of an S3 or PVC source (one per Dataset).
#[derive(Debug, Clone)]
pub enum IngestState {
    /// None ran since the controller started (or for this Dataset).
    NotStarted,
    /// One is running.
    Running { progress: IngestStatus },
    /// The last one put `source` into `key` at `version`.
    Done {
        source: Source,
        key: String,
        version: String,
        bytes: u64,
        status: IngestStatus,
        finished: SystemTime,
    },
    /// The last one, of `source`, failed.
    Failed {
        source: Source,
        reason: String,
        message: String,
        at: SystemTime,
    },
}

/// Everything one reconcile looks at.
#[derive(Debug, Clone)]
pub struct Observed {
    pub dataset: DatasetView,
    /// Every Node of the cluster.
    pub nodes: Vec<ObservedNode>,
    pub source: SourceState,
    pub now: SystemTime,
}

/// The controller's settings the rules use.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How long a seeding broadcast group accepts joins.
    pub seed_window: Duration,
    /// Look again this soon while something is moving.
    pub busy_requeue: Duration,
    /// Look again this soon at a Ready dataset (node-cache agents that died
    /// are noticed at this pace; Node changes wake the controller at once).
    pub ready_requeue: Duration,
    /// Look again this late at a Failed one (and retry a failed ingest).
    pub failed_requeue: Duration,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            seed_window: Duration::from_secs(5),
            busy_requeue: Duration::from_secs(2),
            ready_requeue: Duration::from_secs(30),
            failed_requeue: Duration::from_secs(120),
        }
    }
}

/// An event's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

/// An event on the Dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub type_: EventType,
    pub reason: String,
    pub message: String,
}

/// What the controller does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start (or start again) the ingest of the S3 or PVC source.
    Ingest,
    /// Stop the ingest (the Dataset is being deleted).
    StopIngest,
    /// `PUT` this seed request to the node's agent.
    Seed { node: String, request: SeedRequest },
    /// `DELETE` the dataset from the node's agent (`?retain=true` when
    /// `retain`).
    Unseed { node: String, retain: bool },
    /// Set the dataset's label on the node to `value`.
    Label { node: String, value: String },
    /// Remove the dataset's label from the node.
    Unlabel { node: String },
    /// Record an event on the Dataset.
    Event(Event),
    /// Delete (recursively) the key the Dataset's S3 or PVC source was
    /// ingested into: only in a deleted Dataset's last plan, right before
    /// [`Action::RemoveFinalizer`], with `reclaimPolicy: Delete`.
    DeleteIngested { key: String },
    /// Remove the finalizer: everything is cleaned up.
    RemoveFinalizer,
}

/// The outcome of one reconcile.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub actions: Vec<Action>,
    pub status: DatasetStatus,
    pub requeue: Duration,
}

impl Plan {
    /// The seed requests, by node.
    pub fn seeds(&self) -> Vec<(&str, &SeedRequest)> {
        self.actions
            .iter()
            .filter_map(|a| match a {
                Action::Seed { node, request } => Some((node.as_str(), request)),
                _ => None,
            })
            .collect()
    }

    /// The events.
    pub fn events(&self) -> Vec<&Event> {
        self.actions
            .iter()
            .filter_map(|a| match a {
                Action::Event(e) => Some(e),
                _ => None,
            })
            .collect()
    }
}

/// A version as a label value (at most 63 characters of `[A-Za-z0-9._-]`,
/// starting and ending with an alphanumeric one): the version itself when
/// it is one, else the version with every other character made `-`,
/// trimmed.
pub fn label_value(version: &str) -> String {
    let mapped: String = version
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    mapped
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// Why `key` (`data.kt.dev/<namespace>.<name>`) is not a valid label key,
/// if it is not: its name part (after the `/`) must be at most 63
/// characters of `[A-Za-z0-9._-]`, starting and ending alphanumeric (a
/// Dataset's name may be a 253-character DNS subdomain: too long for it).
pub fn label_key_problem(key: &str) -> Option<String> {
    let name = key.rsplit_once('/').map_or(key, |(_, n)| n);
    let chars_ok = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    let ends_ok = name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    (name.len() > 63 || !chars_ok || !ends_ok).then(|| {
        format!(
            "the node label {key:?} is no valid label key: `<namespace>.<name>` must be at most \
             63 characters ({} here); choose a shorter name",
            name.len()
        )
    })
}

/// Whether a node's labels satisfy the placement's selector and
/// expressions.
pub fn selects(
    selector: &BTreeMap<String, String>,
    expressions: &[NodeSelectorRequirement],
    labels: &BTreeMap<String, String>,
) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
        && expressions.iter().all(|e| {
            let value = labels.get(&e.key);
            match e.operator {
                SelectorOperator::In => value.is_some_and(|v| e.values.contains(v)),
                SelectorOperator::NotIn => value.is_none_or(|v| !e.values.contains(v)),
                SelectorOperator::Exists => value.is_some(),
                SelectorOperator::DoesNotExist => value.is_none(),
            }
        })
}

/// What is to be placed: the key's version, and its size.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    key: String,
    version: String,
    bytes: u64,
}

/// Where the source stands, for the phase, the `SourceReady` condition
/// and the target.
struct SourceView {
    target: Option<Target>,
    /// `Some((reason, message))`: the source is bad, the Dataset `Failed`.
    failed: Option<(String, String)>,
    /// The phase while nothing else decides it (Ingesting, Pending).
    waiting: Option<(Phase, String, String)>,
    ingest: Option<IngestStatus>,
    start_ingest: bool,
    /// Look again by then (a refresh, a back-off).
    next: Option<Duration>,
    condition: (bool, String, String),
}

/// One reconcile: see the module documentation for the rules.
pub fn reconcile(obs: &Observed, settings: &Settings) -> Plan {
    let ds = &obs.dataset;
    let label = node_label(&ds.namespace, &ds.name);
    let prev = ds.status.clone().unwrap_or_default();
    if ds.deleting {
        return cleanup(obs, &label, prev, settings);
    }
    let mut actions = Vec::new();
    let mut status = DatasetStatus {
        observed_generation: ds.generation,
        label: Some(label.clone()),
        desired_nodes: ds.spec.placement.replicas(),
        ..DatasetStatus::default()
    };

    let source = view_source(obs, &prev, settings);
    if source.start_ingest {
        actions.push(Action::Ingest);
    }
    status.ingest = source.ingest.clone().or_else(|| prev.ingest.clone());
    if let Some(t) = &source.target {
        status.key = Some(t.key.clone());
        status.version = Some(t.version.clone());
        status.bytes = Some(t.bytes);
    }

    // A path that can be no dataset's path fails the Dataset at once.
    let path_failure = ds.spec.path.as_deref().and_then(|p| {
        path_problem("/", p).map(|m| ("InvalidPath".to_owned(), format!("spec.path: {m}")))
    });
    // A name whose node label cannot be: no Node would take it.
    let name_failure = label_key_problem(&label).map(|m| ("InvalidName".to_owned(), m));
    let failed = source.failed.clone().or(path_failure).or(name_failure);

    let mut ready_nodes = 0u32;
    let mut placed_short: Option<(String, String)> = None;
    let mut seeding = false;
    let mut members_count = 0u32;
    match (&failed, &source.target) {
        (Some(_), _) => {
            // Nothing moves while the source is bad: what the nodes hold
            // stays (and labelled) until the source is fixed or the Dataset
            // deleted.
            status.nodes = prev.nodes.clone();
            status.ready_nodes = prev.ready_nodes;
            status.path = prev.path.clone();
            status.key = status.key.or(prev.key.clone());
            status.version = status.version.or(prev.version.clone());
            status.bytes = status.bytes.or(prev.bytes);
        }
        (None, Some(target)) => {
            let placed = place(obs, &label, &prev, target, settings, &mut actions);
            ready_nodes = placed.ready;
            members_count = placed.members;
            seeding = placed.moving;
            placed_short = placed.short;
            status.nodes = placed.nodes;
            status.path = placed.path;
            if placed.no_path_fits {
                // Every reachable agent refuses the path.
                let m = ds.spec.path.as_deref().unwrap_or_default();
                let failure = (
                    "InvalidPath".to_owned(),
                    format!("spec.path {m:?} is below no node-cache agent's root"),
                );
                return finish_failed(obs, prev, status, failure, &source, actions, settings);
            }
        }
        (None, None) => {
            // Waiting for the source: keep what the nodes hold.
            status.nodes = prev.nodes.clone();
            status.ready_nodes = prev.ready_nodes;
            status.path = prev.path.clone();
        }
    }
    if let Some(failure) = failed {
        return finish_failed(obs, prev, status, failure, &source, actions, settings);
    }
    status.ready_nodes = if source.target.is_some() {
        ready_nodes
    } else {
        status.ready_nodes
    };
    let desired = status.desired_nodes;

    // The phase and its reason.
    let (phase, reason, message) = if let Some((phase, reason, message)) = source.waiting.clone() {
        (phase, reason, message)
    } else if ready_nodes >= desired && !seeding {
        (
            Phase::Ready,
            "Ready".to_owned(),
            format!("{ready_nodes} of {desired} nodes hold the version"),
        )
    } else if let Some((reason, message)) = placed_short.clone() {
        let phase = if members_count == 0 {
            Phase::Pending
        } else {
            Phase::Seeding
        };
        (phase, reason, message)
    } else {
        (
            Phase::Seeding,
            "Seeding".to_owned(),
            format!("{ready_nodes} of {desired} nodes hold the version"),
        )
    };
    status.phase = phase;
    status.reason = Some(reason.clone());

    let gen_ = ds.generation;
    let placed_cond = match (&source.target, &placed_short) {
        (None, _) => (
            false,
            "SourceNotReady".to_owned(),
            "waiting for the source".to_owned(),
        ),
        (Some(_), Some((r, m))) => (false, r.clone(), m.clone()),
        (Some(_), None) => (
            true,
            "Placed".to_owned(),
            format!("{members_count} of {desired} nodes chosen"),
        ),
    };
    let ready_cond = (phase == Phase::Ready, reason.clone(), message.clone());
    status.conditions = conditions(
        &prev,
        [source.condition.clone(), placed_cond, ready_cond],
        gen_,
        obs.now,
    );

    // Events on a change of phase or reason.
    if prev.phase != phase || prev.reason.as_deref() != Some(reason.as_str()) {
        match phase {
            Phase::Ready => actions.push(event(EventType::Normal, "Ready", &message)),
            Phase::Pending | Phase::Seeding if reason.starts_with("Insufficient") => {
                actions.push(event(EventType::Warning, &reason, &message))
            }
            Phase::Ingesting if prev.phase != Phase::Ingesting => {
                actions.push(event(EventType::Normal, "Ingesting", &message))
            }
            _ => {}
        }
    }

    let mut requeue = if phase == Phase::Ready {
        settings.ready_requeue
    } else {
        settings.busy_requeue
    };
    if let Some(next) = source.next {
        requeue = requeue.min(next.max(Duration::from_secs(1)));
    }
    Plan {
        actions,
        status,
        requeue,
    }
}

fn finish_failed(
    obs: &Observed,
    prev: DatasetStatus,
    mut status: DatasetStatus,
    (reason, message): (String, String),
    source: &SourceView,
    mut actions: Vec<Action>,
    settings: &Settings,
) -> Plan {
    let gen_ = obs.dataset.generation;
    status.phase = Phase::Failed;
    status.reason = Some(reason.clone());
    let source_bad = source.failed.is_some();
    let source_cond = if source_bad {
        (false, reason.clone(), message.clone())
    } else {
        source.condition.clone()
    };
    let failed = (false, reason.clone(), message.clone());
    status.conditions = conditions(&prev, [source_cond, failed.clone(), failed], gen_, obs.now);
    let changed = prev.phase != Phase::Failed
        || prev.reason.as_deref() != Some(reason.as_str())
        || prev.observed_generation != gen_;
    if changed {
        actions.push(event(EventType::Warning, &reason, &message));
    }
    let requeue = match source.next {
        Some(next) => settings
            .failed_requeue
            .min(next.max(Duration::from_secs(1))),
        None => settings.failed_requeue,
    };
    Plan {
        actions,
        status,
        requeue,
    }
}

fn event(type_: EventType, reason: &str, message: &str) -> Action {
    Action::Event(Event {
        type_,
        reason: reason.to_owned(),
        message: message.to_owned(),
    })
}

/// A condition, keeping the previous one's `lastTransitionTime` when its
/// status did not change.
/// The three conditions, SourceReady, Placed and Ready, each as
/// (ok, reason, message).
fn conditions(
    prev: &DatasetStatus,
    [source, placed, ready]: [(bool, String, String); 3],
    generation: Option<i64>,
    now: SystemTime,
) -> Vec<Condition> {
    [(SOURCE_READY, source), (PLACED, placed), (READY, ready)]
        .into_iter()
        .map(|(type_, (ok, reason, message))| {
            condition(prev, type_, ok, &reason, &message, generation, now)
        })
        .collect()
}

fn condition(
    prev: &DatasetStatus,
    type_: &str,
    ok: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: SystemTime,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    let since = prev
        .conditions
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .and_then(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| humantime::format_rfc3339_seconds(now).to_string());
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        last_transition_time: Some(since),
        observed_generation: generation,
    }
}

fn view_source(obs: &Observed, prev: &DatasetStatus, settings: &Settings) -> SourceView {
    let spec = &obs.dataset.spec;
    let interval = match spec
        .refresh
        .interval
        .as_deref()
        .map(humantime::parse_duration)
    {
        Some(Err(e)) => {
            let m = format!("refresh.interval: {e}");
            return failed_source("InvalidRefresh", &m, None);
        }
        Some(Ok(d)) => Some(d),
        None => None,
    };
    // The target the nodes hold while the source is being (re)made.
    let previous = match (&prev.key, &prev.version, prev.bytes) {
        (Some(key), Some(version), Some(bytes)) => Some(Target {
            key: key.clone(),
            version: version.clone(),
            bytes,
        }),
        _ => None,
    };
    match &obs.source {
        SourceState::Key {
            key,
            version,
            bytes,
        } => SourceView {
            target: Some(Target {
                key: key.clone(),
                version: version.clone(),
                bytes: *bytes,
            }),
            failed: None,
            waiting: None,
            ingest: None,
            start_ingest: false,
            next: Some(interval.unwrap_or(DEFAULT_KEY_REFRESH)),
            condition: (
                true,
                "KeyFound".into(),
                format!("{key} at version {version}"),
            ),
        },
        SourceState::NotFound(m) => failed_source("KeyNotFound", m, None),
        SourceState::Invalid { reason, message } => failed_source(reason, message, None),
        SourceState::Unavailable(m) => SourceView {
            waiting: previous
                .is_none()
                .then(|| (Phase::Pending, "SourceUnavailable".to_owned(), m.clone())),
            target: previous,
            failed: None,
            ingest: None,
            start_ingest: false,
            next: Some(settings.busy_requeue),
            condition: (false, "SourceUnavailable".into(), m.clone()),
        },
        SourceState::Ingest(state) => view_ingest(obs, state, previous, interval, settings),
    }
}

fn failed_source(reason: &str, message: &str, next: Option<Duration>) -> SourceView {
    SourceView {
        target: None,
        failed: Some((reason.to_owned(), message.to_owned())),
        waiting: None,
        ingest: None,
        start_ingest: false,
        next,
        condition: (false, reason.to_owned(), message.to_owned()),
    }
}

fn view_ingest(
    obs: &Observed,
    state: &IngestState,
    previous: Option<Target>,
    interval: Option<Duration>,
    settings: &Settings,
) -> SourceView {
    let spec_source = &obs.dataset.spec.source;
    let since = |t: &SystemTime| obs.now.duration_since(*t).unwrap_or_default();
    let ingesting = |message: String, progress: Option<IngestStatus>, start: bool| SourceView {
        waiting: previous
            .is_none()
            .then(|| (Phase::Ingesting, "Ingesting".to_owned(), message.clone())),
        target: previous.clone(),
        failed: None,
        ingest: progress,
        start_ingest: start,
        // Nothing wakes the reconcile when an ingest ends: look again soon,
        // so a refresh of a Ready dataset moves in seconds, not at the
        // Ready requeue.
        next: Some(settings.busy_requeue),
        condition: (false, "Ingesting".into(), message),
    };
    match state {
        IngestState::NotStarted => ingesting("ingest starting".into(), None, true),
        IngestState::Running { progress } => ingesting(
            format!(
                "ingesting: {} objects, {} bytes listed, {} fetched",
                progress.objects, progress.bytes, progress.changed
            ),
            Some(progress.clone()),
            false,
        ),
        IngestState::Failed { source, .. } if source != spec_source => {
            ingesting("the source changed: ingesting again".into(), None, true)
        }
        IngestState::Failed {
            reason,
            message,
            at,
            ..
        } if reason == SOURCE_UNAVAILABLE => {
            // The store was away, not the source bad: like a key source
            // that cannot be asked now — what the nodes hold stays placed
            // and Ready, no Failed phase; tried again soon.
            let retry = UNAVAILABLE_RETRY.min(settings.failed_requeue);
            let waited = since(at);
            let message = format!("{message} (trying again)");
            SourceView {
                waiting: previous.is_none().then(|| {
                    (
                        Phase::Pending,
                        SOURCE_UNAVAILABLE.to_owned(),
                        message.clone(),
                    )
                }),
                target: previous,
                failed: None,
                ingest: None,
                start_ingest: waited >= retry,
                next: Some(retry.saturating_sub(waited)),
                condition: (false, SOURCE_UNAVAILABLE.into(), message),
            }
        }
        IngestState::Failed {
            reason,
            message,
            at,
            ..
        } => {
            let waited = since(at);
            if waited >= settings.failed_requeue {
                ingesting(format!("retrying after: {message}"), None, true)
            } else {
                failed_source(reason, message, Some(settings.failed_requeue - waited))
            }
        }
        IngestState::Done {
            source,
            key,
            version,
            bytes,
            status,
            finished,
        } => {
            let changed = source != spec_source;
            let due = interval.is_some_and(|i| since(finished) >= i);
            let target = Target {
                key: key.clone(),
                version: version.clone(),
                bytes: *bytes,
            };
            SourceView {
                target: Some(target),
                failed: None,
                waiting: None,
                ingest: Some(status.clone()),
                start_ingest: changed || due,
                next: interval.map(|i| i.saturating_sub(since(finished))),
                condition: (
                    true,
                    "Ingested".into(),
                    format!(
                        "{} objects, {} bytes in {key} at version {version}",
                        status.objects, status.bytes
                    ),
                ),
            }
        }
    }
}

/// What placing the target came to.
struct Placed {
    nodes: Vec<NodeStatus>,
    path: Option<String>,
    ready: u32,
    members: u32,
    /// Some node is fetching.
    moving: bool,
    /// Fewer members than wanted: a reason and message.
    short: Option<(String, String)>,
    /// A `spec.path` that no reachable agent accepts.
    no_path_fits: bool,
}

/// A member's state this round.
#[derive(Debug, Clone)]
struct Member {
    node: String,
    state: NodeState,
    version: Option<String>,
    bytes: u64,
    path: String,
    message: Option<String>,
    /// Holds the target Ready.
    ready: bool,
}

fn place(
    obs: &Observed,
    label: &str,
    prev: &DatasetStatus,
    target: &Target,
    settings: &Settings,
    actions: &mut Vec<Action>,
) -> Placed {
    let ds = &obs.dataset;
    let spec = &ds.spec;
    let want = spec.placement.replicas() as usize;
    let retain = spec.reclaim_policy == ReclaimPolicy::Retain;
    let nodes: BTreeMap<&str, &ObservedNode> =
        obs.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let prev_state: BTreeMap<&str, &NodeStatus> =
        prev.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let report = |node: &str| -> Option<&NodeReport> {
        match nodes.get(node).map(|n| &n.agent) {
            Some(Agent::Reachable(r)) => Some(r),
            _ => None,
        }
    };
    let held = |node: &str| -> Option<&NodeDataset> {
        report(node).and_then(|r| r.dataset(&ds.namespace, &ds.name))
    };
    let path_on = |r: &NodeReport| -> Result<String, String> {
        match &spec.path {
            Some(p) => match path_problem(&r.root, p) {
                Some(m) => Err(m),
                None => Ok(p.to_owned()),
            },
            None => Ok(default_path(&r.root, &ds.namespace, &ds.name)),
        }
    };

    // Who is in the placement now.
    let mut candidates_for_membership: BTreeSet<&str> = prev
        .nodes
        .iter()
        .filter(|n| matches!(n.state, NodeState::Seeding | NodeState::Ready))
        .map(|n| n.name.as_str())
        .collect();
    for n in &obs.nodes {
        let excluded = prev_state.get(n.name.as_str()).is_some_and(|p| {
            matches!(
                p.state,
                NodeState::Removing | NodeState::Lost | NodeState::Failed
            )
        });
        if !excluded
            && held(&n.name).is_some_and(|d| d.placed && d.state != NodeDatasetState::Failed)
        {
            candidates_for_membership.insert(n.name.as_str());
        }
    }

    let mut out: Vec<NodeStatus> = Vec::new();
    let mut members: Vec<Member> = Vec::new();
    let mut lost: Vec<(String, String)> = Vec::new();
    let mut failed_nodes: BTreeSet<String> = BTreeSet::new();
    for name in &candidates_for_membership {
        let node = nodes.get(name);
        let gone = match node {
            None => Some(format!("node {name} is gone")),
            Some(n) if !n.ready => Some(format!("node {name} is NotReady")),
            Some(n) => match &n.agent {
                Agent::None => Some(format!("no node-cache agent runs on node {name}")),
                Agent::Unreachable(e) => Some(format!(
                    "the node-cache agent of node {name} is unreachable: {e}"
                )),
                Agent::Reachable(_) => None,
            },
        };
        let prev_node = prev_state.get(name);
        if let Some(why) = gone {
            lost.push((name.to_string(), why.clone()));
            out.push(NodeStatus {
                name: name.to_string(),
                state: NodeState::Lost,
                version: prev_node.and_then(|p| p.version.clone()),
                bytes: prev_node.map(|p| p.bytes).unwrap_or_default(),
                path: prev_node.and_then(|p| p.path.clone()),
                message: Some(why),
            });
            continue;
        }
        let Some(n) = node else { continue };
        let Agent::Reachable(r) = &n.agent else {
            continue;
        };
        if !selects(
            &spec.placement.node_selector,
            &spec.placement.match_expressions,
            &n.labels,
        ) {
            // No longer selected: removed below, like a scale-down.
            members.push(Member {
                node: name.to_string(),
                state: NodeState::Removing,
                version: prev_node.and_then(|p| p.version.clone()),
                bytes: prev_node.map(|p| p.bytes).unwrap_or_default(),
                path: path_on(r).unwrap_or_default(),
                message: Some("no longer selected by the placement".into()),
                ready: false,
            });
            continue;
        }
        let path = match path_on(r) {
            Ok(p) => p,
            Err(m) => {
                failed_nodes.insert(name.to_string());
                out.push(NodeStatus {
                    name: name.to_string(),
                    state: NodeState::Failed,
                    version: None,
                    bytes: 0,
                    path: None,
                    message: Some(m),
                });
                continue;
            }
        };
        let keep_message = prev_node.and_then(|p| p.message.clone());
        let m = match held(name) {
            Some(d) if d.version == target.version && d.state == NodeDatasetState::Failed => {
                failed_nodes.insert(name.to_string());
                let why = format!(
                    "seeding version {} failed: {}",
                    d.version,
                    d.error.as_deref().unwrap_or("no reason given")
                );
                out.push(NodeStatus {
                    name: name.to_string(),
                    state: NodeState::Failed,
                    version: Some(d.version.clone()),
                    bytes: d.bytes,
                    path: Some(d.path.clone()),
                    message: Some(why),
                });
                continue;
            }
            Some(d) if d.version == target.version && d.placed => Member {
                node: name.to_string(),
                state: if d.state == NodeDatasetState::Ready {
                    NodeState::Ready
                } else {
                    NodeState::Seeding
                },
                version: Some(d.version.clone()),
                bytes: d.bytes,
                path: d.path.clone(),
                message: keep_message,
                ready: d.state == NodeDatasetState::Ready,
            },
            other => Member {
                // Not holding the target (nothing, an older version, not
                // placed any more): seeded below.
                node: name.to_string(),
                state: NodeState::Seeding,
                version: Some(target.version.clone()),
                bytes: other.map(|d| d.bytes).unwrap_or_default(),
                path,
                message: keep_message,
                ready: false,
            },
        };
        members.push(m);
    }

    // Too many: the extra ones leave — first those only an agent's report
    // put in (not the status: a lost write, or an agent claiming what it
    // was never given), then not Ready ones, then from the end.
    let in_status = |node: &str| {
        prev_state
            .get(node)
            .is_some_and(|p| matches!(p.state, NodeState::Seeding | NodeState::Ready))
    };
    let (mut keep, mut leaving): (Vec<Member>, Vec<Member>) = members
        .into_iter()
        .partition(|m| m.state != NodeState::Removing);
    if keep.len() > want {
        keep.sort_by(|a, b| {
            in_status(&b.node)
                .cmp(&in_status(&a.node))
                .then(b.ready.cmp(&a.ready))
                .then(a.node.cmp(&b.node))
        });
        for mut m in keep.split_off(want) {
            m.state = NodeState::Removing;
            m.message = Some("no longer placed here (scaled down)".into());
            leaving.push(m);
        }
    }

    // Too few: choose among the candidates.
    let in_use: BTreeSet<String> = keep
        .iter()
        .chain(leaving.iter())
        .map(|m| m.node.clone())
        .chain(lost.iter().map(|(n, _)| n.clone()))
        .chain(failed_nodes.iter().cloned())
        .collect();
    let mut eligible = 0usize;
    let mut path_refusals = 0usize;
    let mut reachable = 0usize;
    let mut fitting: Vec<(&ObservedNode, &NodeReport, String)> = Vec::new();
    for n in &obs.nodes {
        let Agent::Reachable(r) = &n.agent else {
            continue;
        };
        reachable += 1;
        if !n.ready
            || n.unschedulable
            || !selects(
                &spec.placement.node_selector,
                &spec.placement.match_expressions,
                &n.labels,
            )
        {
            continue;
        }
        let path = match path_on(r) {
            Ok(p) => p,
            Err(_) => {
                path_refusals += 1;
                continue;
            }
        };
        eligible += 1;
        if in_use.contains(&n.name) {
            continue;
        }
        let has = r
            .dataset(&ds.namespace, &ds.name)
            .is_some_and(|d| d.version == target.version && d.state != NodeDatasetState::Failed);
        if has || r.free_bytes >= target.bytes {
            fitting.push((n, r, path));
        }
    }
    // A node that failed this version is tried again, but last.
    let previously_failed = |name: &str| {
        prev_state
            .get(name)
            .is_some_and(|p| p.state == NodeState::Failed)
    };
    let rank = |n: &ObservedNode, r: &NodeReport| {
        let d = r.dataset(&ds.namespace, &ds.name);
        let holds =
            d.is_some_and(|d| d.version == target.version && d.state == NodeDatasetState::Ready);
        let older =
            d.is_some_and(|d| d.version != target.version && d.state == NodeDatasetState::Ready);
        (
            !holds,
            !older,
            previously_failed(&n.name),
            std::cmp::Reverse(r.free_bytes),
        )
    };
    fitting
        .sort_by(|(a, ra, _), (b, rb, _)| rank(a, ra).cmp(&rank(b, rb)).then(a.name.cmp(&b.name)));
    let needed = want.saturating_sub(keep.len());
    let mut added: Vec<Member> = Vec::new();
    for (n, r, path) in fitting.into_iter().take(needed) {
        let d = r.dataset(&ds.namespace, &ds.name);
        let holds =
            d.is_some_and(|d| d.version == target.version && d.state == NodeDatasetState::Ready);
        added.push(Member {
            node: n.name.clone(),
            state: if holds && d.is_some_and(|d| d.placed) {
                NodeState::Ready
            } else {
                NodeState::Seeding
            },
            version: Some(target.version.clone()),
            bytes: d
                .filter(|d| d.version == target.version)
                .map(|d| d.bytes)
                .unwrap_or_default(),
            path,
            message: None,
            ready: holds && d.is_some_and(|d| d.placed),
        });
    }
    // Say which node replaced which.
    let mut gone: Vec<String> = lost
        .iter()
        .map(|(n, why)| format!("{n} ({why})"))
        .chain(
            failed_nodes
                .iter()
                .map(|n| format!("{n} (its seed failed)")),
        )
        .collect();
    for m in &mut added {
        if !gone.is_empty() {
            let replaced = gone.remove(0);
            let msg = format!("replaces node {replaced}");
            actions.push(event(
                EventType::Warning,
                "NodeReplaced",
                &format!("node {} {msg}", m.node),
            ));
            m.message = Some(msg);
        }
    }
    for (n, why) in &lost {
        let was = prev_state.get(n.as_str()).map(|p| p.state);
        if was != Some(NodeState::Lost) {
            actions.push(event(EventType::Warning, "NodeLost", why));
        }
    }
    for n in &failed_nodes {
        let was = prev_state.get(n.as_str()).map(|p| p.state);
        if was != Some(NodeState::Failed)
            && let Some(m) = out
                .iter()
                .find(|s| &s.name == n)
                .and_then(|s| s.message.clone())
        {
            actions.push(event(
                EventType::Warning,
                "SeedFailed",
                &format!("node {n}: {m}"),
            ));
        }
    }

    // Seeds: when no member holds or fetches the target, this is the
    // version's first seeding and goes out as one broadcast.
    let first = !keep.iter().any(|m| {
        held(&m.node).is_some_and(|d| {
            d.version == target.version && d.placed && d.state != NodeDatasetState::Failed
        })
    });
    let to_seed: Vec<&Member> = keep
        .iter()
        .chain(added.iter())
        .filter(|m| {
            !held(&m.node).is_some_and(|d| {
                d.version == target.version && d.placed && d.state != NodeDatasetState::Failed
            })
        })
        .collect();
    let broadcast = (first && to_seed.len() > 1).then(|| SeedBroadcast {
        group: format!(
            "dataset-{}-{}-{}",
            ds.uid,
            label_value(&target.version),
            obs.now
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis()
        ),
        fanout: 1,
        window_ms: settings.seed_window.as_millis() as u64,
    });
    if !to_seed.is_empty() {
        let how = match &broadcast {
            Some(b) => format!(" as one broadcast (group {})", b.group),
            None => String::new(),
        };
        let names: Vec<&str> = to_seed.iter().map(|m| m.node.as_str()).collect();
        actions.push(event(
            EventType::Normal,
            "Seeding",
            &format!(
                "seeding {} version {} onto {}{how}",
                target.key,
                target.version,
                names.join(", ")
            ),
        ));
    }
    for m in &to_seed {
        actions.push(Action::Seed {
            node: m.node.clone(),
            request: SeedRequest {
                key: target.key.clone(),
                version: target.version.clone(),
                path: m.path.clone(),
                bytes: target.bytes,
                broadcast: broadcast.clone(),
            },
        });
    }

    // Leaving nodes: unseed while the agent still has it placed.
    for m in &leaving {
        if held(&m.node).is_some_and(|d| d.placed) {
            actions.push(Action::Unseed {
                node: m.node.clone(),
                retain,
            });
        }
    }
    // Nodes outside the placement still holding it placed (back after
    // being lost, failed ones, a status that was lost): unseed.
    let placed_here: BTreeSet<&str> = keep
        .iter()
        .chain(added.iter())
        .chain(leaving.iter())
        .map(|m| m.node.as_str())
        .collect();
    let mut removing_others: Vec<NodeStatus> = Vec::new();
    for n in &obs.nodes {
        if placed_here.contains(n.name.as_str()) || lost.iter().any(|(l, _)| *l == n.name) {
            continue;
        }
        if let Some(d) = held(&n.name).filter(|d| d.placed) {
            actions.push(Action::Unseed {
                node: n.name.clone(),
                retain,
            });
            if !failed_nodes.contains(&n.name) {
                let failed = d.state == NodeDatasetState::Failed;
                removing_others.push(NodeStatus {
                    name: n.name.clone(),
                    state: if failed {
                        NodeState::Failed
                    } else {
                        NodeState::Removing
                    },
                    version: Some(d.version.clone()),
                    bytes: d.bytes,
                    path: Some(d.path.clone()),
                    message: Some(match (&d.error, failed) {
                        (Some(e), true) => format!("seeding version {} failed: {e}", d.version),
                        _ => "not in the placement: removing its copy".into(),
                    }),
                });
            }
        }
    }

    // Labels: a member holding a version Ready carries it; one fetching a
    // newer one keeps what it has; every other node loses it.
    let mut labelled: BTreeSet<&str> = BTreeSet::new();
    for m in keep.iter().chain(added.iter()) {
        let Some(node) = nodes.get(m.node.as_str()) else {
            continue;
        };
        let current = node.labels.get(label);
        match held(&m.node) {
            Some(d) if d.state == NodeDatasetState::Ready && d.placed => {
                let value = label_value(&d.version);
                if current != Some(&value) {
                    actions.push(Action::Label {
                        node: m.node.clone(),
                        value,
                    });
                }
                labelled.insert(m.node.as_str());
            }
            Some(d) if d.state == NodeDatasetState::Seeding && current.is_some() => {
                labelled.insert(m.node.as_str());
            }
            _ => {}
        }
    }
    for n in &obs.nodes {
        if n.labels.contains_key(label) && !labelled.contains(n.name.as_str()) {
            actions.push(Action::Unlabel {
                node: n.name.clone(),
            });
        }
    }

    // Status, by node name; Lost entries from before stay while their Node
    // is still there (so it says which node was lost), Failed ones while
    // the agent still reports the failure.
    let ready = keep.iter().chain(added.iter()).filter(|m| m.ready).count() as u32;
    let moving = keep.iter().chain(added.iter()).any(|m| !m.ready);
    for m in keep.iter().chain(added.iter()).chain(leaving.iter()) {
        out.push(NodeStatus {
            name: m.node.clone(),
            state: m.state,
            version: m.version.clone(),
            bytes: m.bytes,
            path: Some(m.path.clone()),
            message: m.message.clone(),
        });
    }
    out.extend(removing_others);
    for p in &prev.nodes {
        if out.iter().any(|o| o.name == p.name) {
            continue;
        }
        let node = nodes.get(p.name.as_str());
        let keep_it = match p.state {
            NodeState::Lost => {
                node.is_some_and(|n| !n.ready || !matches!(n.agent, Agent::Reachable(_)))
            }
            NodeState::Failed => held(&p.name).is_some_and(|d| d.state == NodeDatasetState::Failed),
            _ => false,
        };
        if keep_it {
            out.push(p.clone());
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));

    let members = (keep.len() + added.len()) as u32;
    let short = (members < want as u32).then(|| {
        if eligible < want {
            (
                "InsufficientNodes".to_owned(),
                format!(
                    "{members} of {want} nodes placed: only {eligible} Ready, schedulable nodes \
                     match the placement and run a reachable node-cache agent"
                ),
            )
        } else {
            (
                "InsufficientCapacity".to_owned(),
                format!(
                    "{members} of {want} nodes placed: {eligible} nodes match the placement, \
                     the others lack {} bytes free",
                    target.bytes
                ),
            )
        }
    });
    let path = keep
        .iter()
        .chain(added.iter())
        .map(|m| m.path.clone())
        .next()
        .or_else(|| spec.path.clone());
    Placed {
        nodes: out,
        path,
        ready,
        members,
        moving,
        short,
        no_path_fits: spec.path.is_some() && reachable > 0 && path_refusals == reachable,
    }
}

/// The key an S3 or PVC source is ingested into (the controller's own).
pub fn ingest_key(namespace: &str, name: &str) -> String {
    format!("datasets/{namespace}/{name}")
}

/// Deletion: stop the ingest, unlabel and unseed every node, then delete
/// the ingested key (per `reclaimPolicy`) and let the finalizer go.
fn cleanup(obs: &Observed, label: &str, prev: DatasetStatus, settings: &Settings) -> Plan {
    let ds = &obs.dataset;
    let retain = ds.spec.reclaim_policy == ReclaimPolicy::Retain;
    let mut actions = Vec::new();
    if matches!(ds.spec.source, Source::S3(_) | Source::Pvc(_))
        && matches!(obs.source, SourceState::Ingest(IngestState::Running { .. }))
    {
        actions.push(Action::StopIngest);
    }
    let mut nodes = Vec::new();
    for n in &obs.nodes {
        if n.labels.contains_key(label) {
            actions.push(Action::Unlabel {
                node: n.name.clone(),
            });
        }
        if let Agent::Reachable(r) = &n.agent
            && let Some(d) = r.dataset(&ds.namespace, &ds.name)
            && d.placed
        {
            actions.push(Action::Unseed {
                node: n.name.clone(),
                retain,
            });
            nodes.push(NodeStatus {
                name: n.name.clone(),
                state: NodeState::Removing,
                version: Some(d.version.clone()),
                bytes: d.bytes,
                path: Some(d.path.clone()),
                message: Some("the Dataset is being deleted".into()),
            });
        }
    }
    let done = actions.is_empty();
    if done {
        // Nothing runs that could put the key back (a running ingest is
        // stopped first, and looked at again until it is gone).
        if !retain && matches!(ds.spec.source, Source::S3(_) | Source::Pvc(_)) {
            actions.push(Action::DeleteIngested {
                key: ingest_key(&ds.namespace, &ds.name),
            });
        }
        actions.push(Action::RemoveFinalizer);
    }
    let status = DatasetStatus {
        nodes,
        ready_nodes: 0,
        ..prev
    };
    Plan {
        actions,
        status,
        requeue: if done {
            settings.ready_requeue
        } else {
            Duration::from_secs(1)
        },
    }
}

#[cfg(test)]
mod tests;
