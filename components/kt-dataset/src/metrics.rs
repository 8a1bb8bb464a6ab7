//! The controller's own metrics, published on `/metrics` next to the
//! shared ones of [`kt_service::Metrics`] (register them with
//! [`kt_service::Metrics::with`] and [`Stats::register`]; names get the
//! `kt_` prefix).
//!
//! Invariant: every label's values come from a fixed set in this crate (a
//! phase, a node state, an error kind, a reason the controller itself
//! names), never from a Dataset's or a node's name, so the number of
//! series is bounded however many Datasets and nodes there are.
//!
//! - `kt_dataset_datasets{phase}`: Datasets by phase (as last written);
//! - `kt_dataset_nodes{state}`: nodes of all Datasets' statuses by state
//!   (a node holding two Datasets counts twice);
//! - `kt_dataset_node_caches{state}`: nodes by their node-cache agent as
//!   last observed (`reachable`, `unreachable`, `none`);
//! - `kt_dataset_reconciles_total`, `kt_dataset_reconcile_errors_total{kind}`
//!   (reconciles that ended in an error, retried soon);
//! - `kt_dataset_failures_total{reason}`: Datasets turning `Failed`, by
//!   reason (`KeyNotFound`, `InvalidPath`, ...);
//! - `kt_dataset_seeds_total{mode}` (`broadcast`, `get`), `kt_dataset_seed_refusals_total`,
//!   `kt_dataset_unseeds_total`, `kt_dataset_ingests_started_total`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::crd::{DatasetStatus, NodeState, Phase};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabel {
    mode: &'static str,
}

/// The reasons a Dataset fails with, as this crate names them; any other
/// string is counted as `Other` (the label set stays bounded).
const FAILURE_REASONS: &[&str] = &[
    "KeyNotFound",
    "InvalidKey",
    "KeyForbidden",
    "NotFilesystemData",
    "InvalidPath",
    "InvalidName",
    "InvalidRefresh",
    "InvalidSource",
    "Unsupported",
    "CredentialsNotFound",
    "IngestFailed",
];

const PHASES: [Phase; 5] = [
    Phase::Pending,
    Phase::Ingesting,
    Phase::Seeding,
    Phase::Ready,
    Phase::Failed,
];

const NODE_STATES: [NodeState; 5] = [
    NodeState::Seeding,
    NodeState::Ready,
    NodeState::Failed,
    NodeState::Lost,
    NodeState::Removing,
];

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Pending => "Pending",
        Phase::Ingesting => "Ingesting",
        Phase::Seeding => "Seeding",
        Phase::Ready => "Ready",
        Phase::Failed => "Failed",
    }
}

fn state_name(s: NodeState) -> &'static str {
    match s {
        NodeState::Seeding => "Seeding",
        NodeState::Ready => "Ready",
        NodeState::Failed => "Failed",
        NodeState::Lost => "Lost",
        NodeState::Removing => "Removing",
    }
}

/// What one Dataset contributes to the gauges.
#[derive(Debug, Clone, Copy, Default)]
struct Contribution {
    phase: Option<Phase>,
    nodes: [i64; 5],
}

/// Counts for `/metrics` (and tests).
#[derive(Debug, Default)]
pub struct Stats {
    /// Reconciles begun.
    pub reconciles: AtomicU64,
    /// Reconciles that ended in an error.
    pub failures: AtomicU64,
    reconciles_total: Counter,
    errors: Family<KindLabel, Counter>,
    failed: Family<ReasonLabel, Counter>,
    seeds: Family<ModeLabel, Counter>,
    refusals: Counter,
    unseeds: Counter,
    ingests: Counter,
    datasets: Family<PhaseLabel, Gauge>,
    nodes: Family<StateLabel, Gauge>,
    caches: Family<StateLabel, Gauge>,
    /// Each Dataset's part of the gauges, by namespace and name (a map,
    /// not labels: see the module's invariant).
    seen: Mutex<HashMap<(String, String), Contribution>>,
}

impl Stats {
    /// Adds these metrics to `registry` (they share their values with
    /// `self`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "dataset_reconciles",
            "Reconciles of Datasets begun",
            self.reconciles_total.clone(),
        );
        registry.register(
            "dataset_reconcile_errors",
            "Reconciles that ended in an error (retried soon), by kind",
            self.errors.clone(),
        );
        registry.register(
            "dataset_failures",
            "Datasets that turned Failed, by reason",
            self.failed.clone(),
        );
        registry.register(
            "dataset_seeds",
            "Seed requests sent to node-cache agents, by mode (broadcast, get)",
            self.seeds.clone(),
        );
        registry.register(
            "dataset_seed_refusals",
            "Seed requests a node-cache agent refused or did not answer",
            self.refusals.clone(),
        );
        registry.register(
            "dataset_unseeds",
            "Unseed requests sent to node-cache agents",
            self.unseeds.clone(),
        );
        registry.register(
            "dataset_ingests_started",
            "Ingests of S3 or PVC sources started",
            self.ingests.clone(),
        );
        registry.register(
            "dataset_datasets",
            "Datasets by phase, as last written",
            self.datasets.clone(),
        );
        registry.register(
            "dataset_nodes",
            "Nodes in the Datasets' statuses, by state (per Dataset)",
            self.nodes.clone(),
        );
        registry.register(
            "dataset_node_caches",
            "Nodes by their node-cache agent as last observed",
            self.caches.clone(),
        );
        // Every series exists from the start (a 0 is an answer).
        for p in PHASES {
            let _ = self.datasets.get_or_create(&PhaseLabel {
                phase: phase_name(p),
            });
        }
        for s in NODE_STATES {
            let _ = self.nodes.get_or_create(&StateLabel {
                state: state_name(s),
            });
        }
        for s in ["reachable", "unreachable", "none"] {
            let _ = self.caches.get_or_create(&StateLabel { state: s });
        }
    }

    pub(crate) fn reconcile_begun(&self) {
        self.reconciles.fetch_add(1, Ordering::Relaxed);
        self.reconciles_total.inc();
    }

    pub(crate) fn reconcile_error(&self, kind: &'static str) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        self.errors.get_or_create(&KindLabel { kind }).inc();
    }

    pub(crate) fn turned_failed(&self, reason: &str) {
        let reason = if FAILURE_REASONS.contains(&reason) {
            reason
        } else {
            "Other"
        };
        self.failed
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub(crate) fn seed_sent(&self, broadcast: bool) {
        let mode = if broadcast { "broadcast" } else { "get" };
        self.seeds.get_or_create(&ModeLabel { mode }).inc();
    }

    pub(crate) fn seed_refused(&self) {
        self.refusals.inc();
    }

    pub(crate) fn unseed_sent(&self) {
        self.unseeds.inc();
    }

    pub(crate) fn ingest_started(&self) {
        self.ingests.inc();
    }

    /// The node-cache agents as one observation found them.
    pub(crate) fn node_caches(&self, reachable: usize, unreachable: usize, none: usize) {
        for (state, n) in [
            ("reachable", reachable),
            ("unreachable", unreachable),
            ("none", none),
        ] {
            self.caches
                .get_or_create(&StateLabel { state })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// A Dataset's status as written (`None`: it is gone).
    pub fn dataset(&self, namespace: &str, name: &str, status: Option<&DatasetStatus>) {
        let Ok(mut seen) = self.seen.lock() else {
            return;
        };
        let id = (namespace.to_owned(), name.to_owned());
        match status {
            None => {
                seen.remove(&id);
            }
            Some(s) => {
                let mut c = Contribution {
                    phase: Some(s.phase),
                    nodes: [0; 5],
                };
                for n in &s.nodes {
                    if let Some(i) = NODE_STATES.iter().position(|x| *x == n.state) {
                        c.nodes[i] += 1;
                    }
                }
                seen.insert(id, c);
            }
        }
        for p in PHASES {
            let n = seen.values().filter(|c| c.phase == Some(p)).count();
            self.datasets
                .get_or_create(&PhaseLabel {
                    phase: phase_name(p),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        for (i, s) in NODE_STATES.iter().enumerate() {
            let n: i64 = seen.values().map(|c| c.nodes[i]).sum();
            self.nodes
                .get_or_create(&StateLabel {
                    state: state_name(*s),
                })
                .set(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::NodeStatus;

    fn encode(stats: &Stats) -> String {
        let mut r = Registry::with_prefix("kt");
        stats.register(&mut r);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        out
    }

    fn status(phase: Phase, nodes: &[(&str, NodeState)]) -> DatasetStatus {
        DatasetStatus {
            phase,
            nodes: nodes
                .iter()
                .map(|(n, s)| NodeStatus {
                    name: (*n).to_owned(),
                    state: *s,
                    version: None,
                    bytes: 0,
                    path: None,
                    message: None,
                })
                .collect(),
            ..DatasetStatus::default()
        }
    }

    #[test]
    fn gauges_follow_the_statuses_written_and_names_are_no_labels() {
        let stats = Stats::default();
        let text = encode(&stats);
        assert!(
            text.contains("kt_dataset_datasets{phase=\"Ready\"} 0"),
            "{text}"
        );
        let a = status(
            Phase::Ready,
            &[("node-1", NodeState::Ready), ("node-2", NodeState::Ready)],
        );
        let b = status(Phase::Seeding, &[("node-1", NodeState::Seeding)]);
        stats.dataset("team", "secret-project-a", Some(&a));
        stats.dataset("team", "b", Some(&b));
        stats.dataset("team", "b", Some(&b));
        let text = encode(&stats);
        for line in [
            "kt_dataset_datasets{phase=\"Ready\"} 1",
            "kt_dataset_datasets{phase=\"Seeding\"} 1",
            "kt_dataset_nodes{state=\"Ready\"} 2",
            "kt_dataset_nodes{state=\"Seeding\"} 1",
        ] {
            assert!(text.contains(line), "{line}\n{text}");
        }
        assert!(!text.contains("secret-project-a") && !text.contains("node-1"));
        stats.dataset("team", "secret-project-a", None);
        let text = encode(&stats);
        assert!(
            text.contains("kt_dataset_datasets{phase=\"Ready\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("kt_dataset_nodes{state=\"Ready\"} 0"),
            "{text}"
        );
    }

    #[test]
    fn failure_reasons_are_a_bounded_set() {
        let stats = Stats::default();
        stats.turned_failed("KeyNotFound");
        stats.turned_failed("whatever a user wrote");
        stats.reconcile_begun();
        stats.reconcile_error("kube");
        stats.seed_sent(true);
        let text = encode(&stats);
        for line in [
            "kt_dataset_failures_total{reason=\"KeyNotFound\"} 1",
            "kt_dataset_failures_total{reason=\"Other\"} 1",
            "kt_dataset_reconciles_total 1",
            "kt_dataset_reconcile_errors_total{kind=\"kube\"} 1",
            "kt_dataset_seeds_total{mode=\"broadcast\"} 1",
        ] {
            assert!(text.contains(line), "{line}\n{text}");
        }
        assert!(!text.contains("whatever"));
    }
}
