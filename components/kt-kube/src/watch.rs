//! The namespace watch: kube-runtime watchers on pods and workloads carrying
//! [`SERVICE_LABEL`], fed to the [`ClusterState`] machine, whose actions go
//! to a channel. Watch errors are logged and retried with a backoff, never
//! fatal: the metadata server serves on while the API server is away.

use std::fmt::Debug;
use std::time::Duration;

use futures::stream::{BoxStream, SelectAll};
use futures::{Stream, StreamExt};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::Pod;
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::SERVICE_LABEL;
use crate::state::{Action, ClusterState, Event, Kind, Object, RecordedAgent};

/// How the watch runs.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    pub namespace: String,
    /// First delay after a watch error; doubled per error up to `backoff_max`.
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
}

impl WatchConfig {
    pub fn new(namespace: impl Into<String>) -> Self {
        WatchConfig {
            namespace: namespace.into(),
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
        }
    }
}

/// The watcher's backoff: kt's one backoff ([`kt_api::Backoff`]: exponential
/// with jitter), reset by the watcher on success.
#[derive(Debug, Clone)]
pub struct ExpBackoff(kt_api::Backoff);

impl ExpBackoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        ExpBackoff(kt_api::Backoff::new(initial, max))
    }
}

impl Iterator for ExpBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(self.0.next_delay())
    }
}

impl Backoff for ExpBackoff {
    fn reset(&mut self) {
        self.0.reset();
    }
}

type Tagged = (Kind, Result<Event, watcher::Error>);

fn convert<K>(
    kind: Kind,
    to_object: fn(&K) -> Object,
) -> impl FnMut(Result<watcher::Event<K>, watcher::Error>) -> Tagged {
    move |r| {
        let event = r.map(|e| match e {
            watcher::Event::Apply(o) => Event::Apply(kind, to_object(&o)),
            watcher::Event::Delete(o) => Event::Delete(kind, to_object(&o)),
            watcher::Event::Init => Event::Init(kind),
            watcher::Event::InitApply(o) => Event::InitApply(kind, to_object(&o)),
            watcher::Event::InitDone => Event::InitDone(kind),
        });
        (kind, event)
    }
}

fn pod_object(p: &Pod) -> Object {
    let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
    Object {
        name: p.name_any(),
        service: p.labels().get(SERVICE_LABEL).cloned(),
        gone: matches!(phase, Some("Succeeded" | "Failed")),
    }
}

fn meta_object<K>(o: &PartialObjectMeta<K>) -> Object {
    Object {
        name: o.metadata.name.clone().unwrap_or_default(),
        service: o
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_LABEL).cloned()),
        gone: false,
    }
}

fn workload<K>(client: &Client, cfg: &WatchConfig, kind: Kind) -> BoxStream<'static, Tagged>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static,
{
    let api: Api<PartialObjectMeta<K>> = Api::namespaced(client.clone(), &cfg.namespace);
    watcher(api, watcher_config())
        .backoff(ExpBackoff::new(cfg.backoff_initial, cfg.backoff_max))
        .map(convert(kind, meta_object::<K>))
        .boxed()
}

fn watcher_config() -> watcher::Config {
    watcher::Config::default().labels(SERVICE_LABEL)
}

/// Every watched kind's events, merged.
pub fn events(client: &Client, cfg: &WatchConfig) -> impl Stream<Item = Tagged> + Send + use<> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &cfg.namespace);
    let mut all: SelectAll<BoxStream<'static, Tagged>> = SelectAll::new();
    all.push(
        watcher(pods, watcher_config())
            .backoff(ExpBackoff::new(cfg.backoff_initial, cfg.backoff_max))
            .map(convert(Kind::Pod, pod_object))
            .boxed(),
    );
    all.push(workload::<Deployment>(client, cfg, Kind::Deployment));
    all.push(workload::<StatefulSet>(client, cfg, Kind::StatefulSet));
    all.push(workload::<DaemonSet>(client, cfg, Kind::DaemonSet));
    all.push(workload::<ReplicaSet>(client, cfg, Kind::ReplicaSet));
    all.push(workload::<Job>(client, cfg, Kind::Job));
    all.push(workload::<CronJob>(client, cfg, Kind::CronJob));
    all
}

/// Watches until `shutdown`, sending each decision to `actions`. `recorded`
/// are the registry's agents at start (see [`crate::state`] for the rules).
/// Returns when `shutdown` is cancelled or `actions` is closed.
pub async fn run(
    client: Client,
    cfg: WatchConfig,
    recorded: Vec<RecordedAgent>,
    actions: mpsc::UnboundedSender<Action>,
    shutdown: CancellationToken,
) {
    tracing::info!(namespace = %cfg.namespace, label = SERVICE_LABEL, "watching pods and workloads");
    let mut state = ClusterState::new(recorded);
    let mut events = std::pin::pin!(events(&client, &cfg));
    let mut was_synced = false;
    loop {
        let next = tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = actions.closed() => return,
            next = events.next() => next,
        };
        let Some((kind, event)) = next else {
            tracing::warn!("every watch stream ended; no more cluster events");
            return;
        };
        let event = match event {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(kind = kind.as_str(), error = %e, "watch failed; retrying after a backoff");
                continue;
            }
        };
        tracing::trace!(?event, "cluster event");
        for action in state.handle(event) {
            if actions.send(action).is_err() {
                return;
            }
        }
        if !was_synced && state.synced() {
            was_synced = true;
            tracing::info!(
                services = state.live_services().count(),
                "cluster listed; pods and services are followed"
            );
        }
    }
}
