//! The watch's decisions as a pure state machine: watcher events in, actions
//! out. No kube I/O, no clock: [`crate::watch`] feeds it.
//!
//! Rules:
//! - **Pods.** A pod that is deleted (a `Delete` event, or missing from a
//!   relist), or that reaches phase `Succeeded`/`Failed`, is gone: its agent
//!   (agents use their pod name as id) is evicted at once, once.
//! - **Services.** A service (value of [`crate::SERVICE_LABEL`]) is *live*
//!   while a workload carrying the label exists or one of its pods is not
//!   gone (bare pods and a deleted Deployment's pods still terminating keep it
//!   live). A CronJob is such a workload: between its runs it has no pod
//!   (and the Jobs it spawns may carry no label), yet its service's keys are
//!   what the next run reads. A service the machine has seen live and then sees with neither is
//!   torn down, once. Nothing is decided about services until every watched
//!   kind has been listed once, so a partial start never tears anything down.
//! - **Startup.** The registry's agents (id and service, as recorded before
//!   this watch started) are checked against the first complete listing: an
//!   agent with a service whose pod is not listed (or is gone) is evicted (it
//!   comes back with its next heartbeat if it lives after all). A recorded
//!   service with no pod and no workload is *not* torn down: deleting data
//!   needs having seen the service go, and a restore or a GitOps sync may
//!   bring the metadata server up before the workloads. Its `resource` keys
//!   stay until `kt teardown` or their TTL. Agents without a service (not
//!   sidecars of a labelled pod) are left to the heartbeat TTL.
//! - **Relists.** A watch that restarts (`Init`…`InitDone`) replaces what was
//!   known of its kind; what vanished is handled as deleted. The state (and
//!   the set of services seen live) outlives watch restarts.

use std::collections::{BTreeMap, BTreeSet};

/// The watched kinds: pods and the workloads that own them (a CronJob
/// owns its pods through the Jobs it spawns).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Pod,
    Deployment,
    StatefulSet,
    DaemonSet,
    ReplicaSet,
    Job,
    CronJob,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::Pod,
        Kind::Deployment,
        Kind::StatefulSet,
        Kind::DaemonSet,
        Kind::ReplicaSet,
        Kind::Job,
        Kind::CronJob,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Pod => "pod",
            Kind::Deployment => "deployment",
            Kind::StatefulSet => "statefulset",
            Kind::DaemonSet => "daemonset",
            Kind::ReplicaSet => "replicaset",
            Kind::Job => "job",
            Kind::CronJob => "cronjob",
        }
    }
}

/// What the machine needs of one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    pub name: String,
    /// The value of [`crate::SERVICE_LABEL`].
    pub service: Option<String>,
    /// A pod in phase `Succeeded` or `Failed` (always false for workloads).
    pub gone: bool,
}

impl Object {
    pub fn new(name: impl Into<String>, service: impl Into<String>) -> Self {
        Object {
            name: name.into(),
            service: Some(service.into()),
            gone: false,
        }
    }

    /// The same pod, finished.
    pub fn finished(mut self) -> Self {
        self.gone = true;
        self
    }
}

/// One watcher event, tagged with its kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Apply(Kind, Object),
    Delete(Kind, Object),
    Init(Kind),
    InitApply(Kind, Object),
    InitDone(Kind),
}

/// What the metadata server must do.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Action {
    /// Evict the agents with these ids (pod names) as sources.
    Evict(Vec<String>),
    /// Tear the service down, as `DELETE /api/v1/services/{name}`.
    Teardown(String),
}

/// An agent the registry knew when the watch started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedAgent {
    pub id: String,
    pub service: Option<String>,
}

#[derive(Debug, Clone)]
struct Pod {
    service: Option<String>,
    gone: bool,
}

/// The watch's state; see the module docs for the rules.
#[derive(Debug, Clone, Default)]
pub struct ClusterState {
    pods: BTreeMap<String, Pod>,
    /// By kind and name: the service label.
    workloads: BTreeMap<(Kind, String), Option<String>>,
    /// Objects of a relist in progress, by kind.
    relisting: BTreeMap<Kind, Vec<Object>>,
    /// Kinds listed at least once.
    synced: BTreeSet<Kind>,
    /// Services seen live and not torn down since.
    live: BTreeSet<String>,
    /// The registry's agents, until the first complete listing checks them.
    recorded: Option<Vec<RecordedAgent>>,
}

impl ClusterState {
    /// A machine that will check `recorded` against its first complete listing.
    pub fn new(recorded: Vec<RecordedAgent>) -> Self {
        ClusterState {
            recorded: Some(recorded),
            ..ClusterState::default()
        }
    }

    /// True once every kind has been listed.
    pub fn synced(&self) -> bool {
        Kind::ALL.iter().all(|k| self.synced.contains(k))
    }

    /// Services currently live (seen, not torn down).
    pub fn live_services(&self) -> impl Iterator<Item = &str> {
        self.live.iter().map(String::as_str)
    }

    /// Applies one event; the actions it calls for, evictions first.
    pub fn handle(&mut self, event: Event) -> Vec<Action> {
        let mut evict = Vec::new();
        match event {
            Event::Apply(Kind::Pod, o) => self.apply_pod(o, &mut evict),
            Event::Delete(Kind::Pod, o) => {
                // Unknown or still running: its agent goes now. Already gone: done.
                if !self.pods.remove(&o.name).is_some_and(|p| p.gone) {
                    evict.push(o.name);
                }
            }
            Event::Apply(kind, o) => {
                self.workloads.insert((kind, o.name), o.service);
            }
            Event::Delete(kind, o) => {
                self.workloads.remove(&(kind, o.name));
            }
            Event::Init(kind) => {
                self.relisting.insert(kind, Vec::new());
            }
            Event::InitApply(kind, o) => self.relisting.entry(kind).or_default().push(o),
            Event::InitDone(kind) => {
                let listed = self.relisting.remove(&kind).unwrap_or_default();
                self.replace(kind, listed, &mut evict);
                let first_pod_listing = kind == Kind::Pod && self.synced.insert(kind);
                self.synced.insert(kind);
                if first_pod_listing {
                    self.evict_recorded(&mut evict);
                }
            }
        }
        let mut actions = Vec::new();
        if !evict.is_empty() {
            evict.sort();
            evict.dedup();
            actions.push(Action::Evict(evict));
        }
        actions.extend(self.reconcile().into_iter().map(Action::Teardown));
        actions
    }

    fn apply_pod(&mut self, o: Object, evict: &mut Vec<String>) {
        let was_gone = self.pods.get(&o.name).is_some_and(|p| p.gone);
        if o.gone && !was_gone {
            evict.push(o.name.clone());
        }
        self.pods.insert(
            o.name,
            Pod {
                service: o.service,
                gone: o.gone,
            },
        );
    }

    /// A complete listing of `kind` replaces what was known of it.
    fn replace(&mut self, kind: Kind, listed: Vec<Object>, evict: &mut Vec<String>) {
        if kind == Kind::Pod {
            let names: BTreeSet<&str> = listed.iter().map(|o| o.name.as_str()).collect();
            for (name, p) in &self.pods {
                if !p.gone && !names.contains(name.as_str()) {
                    evict.push(name.clone());
                }
            }
            // What is listed is applied over what was known of it.
            self.pods.retain(|name, _| names.contains(name.as_str()));
            for o in listed {
                self.apply_pod(o, evict);
            }
        } else {
            self.workloads.retain(|(k, _), _| *k != kind);
            for o in listed {
                self.workloads.insert((kind, o.name), o.service);
            }
        }
    }

    /// At the first pod listing: recorded sidecar agents without a running pod.
    fn evict_recorded(&mut self, evict: &mut Vec<String>) {
        let Some(recorded) = &self.recorded else {
            return;
        };
        for a in recorded {
            let running = self.pods.get(&a.id).is_some_and(|p| !p.gone);
            if a.service.is_some() && !running {
                evict.push(a.id.clone());
            }
        }
    }

    /// Services with a workload or a pod not gone.
    fn alive_now(&self) -> BTreeSet<String> {
        let pods = self
            .pods
            .values()
            .filter(|p| !p.gone)
            .filter_map(|p| p.service.clone());
        let workloads = self.workloads.values().flatten().cloned();
        pods.chain(workloads).collect()
    }

    /// Services to tear down now (only once every kind is listed).
    fn reconcile(&mut self) -> Vec<String> {
        if !self.synced() {
            return Vec::new();
        }
        let now = self.alive_now();
        let down: BTreeSet<String> = self.live.difference(&now).cloned().collect();
        // Recorded services absent from the first listing are left alone
        // (see the module documentation): only what was seen go is torn down.
        self.recorded = None;
        self.live = now;
        down.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, service: &str) -> Object {
        Object::new(name, service)
    }

    fn evict(ids: &[&str]) -> Action {
        Action::Evict(ids.iter().map(|s| s.to_string()).collect())
    }

    fn down(s: &str) -> Action {
        Action::Teardown(s.into())
    }

    /// Lists every kind: `objects` for the kinds named, nothing for the rest.
    fn list_all(st: &mut ClusterState, objects: &[(Kind, Object)]) -> Vec<Action> {
        let mut out = Vec::new();
        for kind in Kind::ALL {
            out.extend(st.handle(Event::Init(kind)));
            for (k, o) in objects.iter().filter(|(k, _)| *k == kind) {
                out.extend(st.handle(Event::InitApply(*k, o.clone())));
            }
            out.extend(st.handle(Event::InitDone(kind)));
        }
        out
    }

    #[test]
    fn a_deleted_pod_is_evicted_once() {
        let mut st = ClusterState::new(vec![]);
        assert!(list_all(&mut st, &[(Kind::Pod, pod("p1", "s"))]).is_empty());
        assert_eq!(
            st.handle(Event::Apply(Kind::Pod, pod("p1", "s").finished())),
            vec![evict(&["p1"]), down("s")],
            "a finished bare pod is gone, and so is its service"
        );
        assert!(
            st.handle(Event::Delete(Kind::Pod, pod("p1", "s")))
                .is_empty(),
            "already evicted"
        );
    }

    #[test]
    fn a_service_goes_when_its_last_workload_and_pod_go() {
        let mut st = ClusterState::new(vec![]);
        let listed = [
            (Kind::Deployment, pod("web", "s")),
            (Kind::ReplicaSet, pod("web-1", "s")),
            (Kind::Pod, pod("web-1-a", "s")),
            (Kind::Pod, pod("web-1-b", "s")),
        ];
        assert!(list_all(&mut st, &listed).is_empty());
        assert!(
            st.handle(Event::Delete(Kind::Deployment, pod("web", "s")))
                .is_empty()
        );
        assert!(
            st.handle(Event::Delete(Kind::ReplicaSet, pod("web-1", "s")))
                .is_empty()
        );
        assert_eq!(
            st.handle(Event::Delete(Kind::Pod, pod("web-1-a", "s"))),
            vec![evict(&["web-1-a"])],
            "a pod still terminates: the service stays"
        );
        assert_eq!(
            st.handle(Event::Delete(Kind::Pod, pod("web-1-b", "s"))),
            vec![evict(&["web-1-b"]), down("s")]
        );
        assert!(st.live_services().next().is_none());
    }

    #[test]
    fn a_finished_job_keeps_its_service_until_the_job_is_deleted() {
        let mut st = ClusterState::new(vec![]);
        let listed = [
            (Kind::Job, pod("train", "s")),
            (Kind::Pod, pod("train-x", "s")),
        ];
        list_all(&mut st, &listed);
        assert_eq!(
            st.handle(Event::Apply(Kind::Pod, pod("train-x", "s").finished())),
            vec![evict(&["train-x"])]
        );
        assert_eq!(
            st.handle(Event::Delete(Kind::Job, pod("train", "s"))),
            vec![down("s")]
        );
    }

    #[test]
    fn a_cronjob_keeps_its_service_between_runs() {
        let mut st = ClusterState::new(vec![]);
        // A run: the CronJob, and its pod (the spawned Job unlabelled).
        let listed = [
            (Kind::CronJob, pod("nightly", "s")),
            (Kind::Pod, pod("nightly-29-x", "s")),
        ];
        assert!(list_all(&mut st, &listed).is_empty());
        assert_eq!(
            st.handle(Event::Apply(Kind::Pod, pod("nightly-29-x", "s").finished())),
            vec![evict(&["nightly-29-x"])],
            "the run's pod is gone; the CronJob keeps the service"
        );
        assert_eq!(
            st.handle(Event::Delete(Kind::Pod, pod("nightly-29-x", "s"))),
            vec![],
            "the Job's history limit deletes the pod: still kept"
        );
        assert_eq!(st.live_services().collect::<Vec<_>>(), ["s"]);
        assert_eq!(
            st.handle(Event::Delete(Kind::CronJob, pod("nightly", "s"))),
            vec![down("s")],
            "the CronJob deleted: the service goes"
        );
    }

    #[test]
    fn nothing_is_torn_down_before_every_kind_is_listed() {
        let mut st = ClusterState::new(vec![]);
        st.handle(Event::Init(Kind::Pod));
        st.handle(Event::InitApply(Kind::Pod, pod("p1", "s")));
        st.handle(Event::InitDone(Kind::Pod));
        assert_eq!(
            st.handle(Event::Delete(Kind::Pod, pod("p1", "s"))),
            vec![evict(&["p1"])],
            "evictions need no full listing; teardowns do (s was never seen live)"
        );
        assert!(!st.synced());
        // A service never seen live is never torn down.
        let mut st = ClusterState::new(vec![]);
        assert!(list_all(&mut st, &[]).is_empty());
    }

    #[test]
    fn a_relist_handles_what_vanished_as_deleted() {
        let mut st = ClusterState::new(vec![]);
        let listed = [
            (Kind::StatefulSet, pod("db", "a")),
            (Kind::Pod, pod("db-0", "a")),
            (Kind::Pod, pod("bare", "b")),
        ];
        list_all(&mut st, &listed);
        // The pod watch restarts (410 Gone): db-0 was deleted meanwhile.
        st.handle(Event::Init(Kind::Pod));
        st.handle(Event::InitApply(Kind::Pod, pod("bare", "b")));
        assert_eq!(
            st.handle(Event::InitDone(Kind::Pod)),
            vec![evict(&["db-0"])],
            "the StatefulSet keeps service a"
        );
        st.handle(Event::Init(Kind::StatefulSet));
        assert_eq!(
            st.handle(Event::InitDone(Kind::StatefulSet)),
            vec![down("a")]
        );
        // Bare pod b finished while the watch was away.
        st.handle(Event::Init(Kind::Pod));
        st.handle(Event::InitApply(Kind::Pod, pod("bare", "b").finished()));
        assert_eq!(
            st.handle(Event::InitDone(Kind::Pod)),
            vec![evict(&["bare"]), down("b")]
        );
    }

    #[test]
    fn startup_checks_the_registry_against_the_first_listing() {
        let recorded = vec![
            RecordedAgent {
                id: "old-0".into(),
                service: Some("gone".into()),
            },
            RecordedAgent {
                id: "web-a".into(),
                service: Some("web".into()),
            },
            RecordedAgent {
                id: "web-b".into(),
                service: Some("web".into()),
            },
            RecordedAgent {
                id: "laptop".into(),
                service: None,
            },
        ];
        let mut st = ClusterState::new(recorded);
        let listed = [
            (Kind::Deployment, pod("web", "web")),
            (Kind::Pod, pod("web-a", "web")),
        ];
        let actions = list_all(&mut st, &listed);
        assert_eq!(
            actions,
            vec![evict(&["old-0", "web-b"])],
            "agents without a pod go; a service never seen live here is not torn down; the laptop agent is the TTL's"
        );
        // Checked once: a later relist does not repeat it.
        st.handle(Event::Init(Kind::Pod));
        st.handle(Event::InitApply(Kind::Pod, pod("web-a", "web")));
        assert!(st.handle(Event::InitDone(Kind::Pod)).is_empty());
    }

    #[test]
    fn a_service_that_comes_back_is_torn_down_again_when_it_goes() {
        let mut st = ClusterState::new(vec![]);
        list_all(&mut st, &[]);
        assert!(st.handle(Event::Apply(Kind::Job, pod("j", "s"))).is_empty());
        assert_eq!(
            st.handle(Event::Delete(Kind::Job, pod("j", "s"))),
            vec![down("s")]
        );
        assert!(
            st.handle(Event::Apply(Kind::DaemonSet, pod("d", "s")))
                .is_empty()
        );
        assert_eq!(
            st.handle(Event::Delete(Kind::DaemonSet, pod("d", "s"))),
            vec![down("s")]
        );
    }
}
