//! The rules of [`super::reconcile`], one by one, on hand-made observations.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use kt_types::dataset::{NodeDataset, NodeDatasetState, NodeReport, SeedRequest};

use super::*;
use crate::crd::{DatasetSpec, DatasetStatus, NodeState, Phase};

const GIB: u64 = 1 << 30;
const ROOT: &str = "/var/lib/kt/datasets";

fn spec(yaml: &str) -> DatasetSpec {
    crate::crd::from_yaml(yaml).unwrap()
}

fn t(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
}

fn report(node: &str, free: u64, datasets: Vec<NodeDataset>) -> Agent {
    Agent::Reachable(NodeReport {
        node: node.into(),
        root: ROOT.into(),
        budget_bytes: 100 * GIB,
        used_bytes: 0,
        free_bytes: free,
        datasets,
    })
}

fn held(version: &str, state: NodeDatasetState, placed: bool) -> NodeDataset {
    NodeDataset {
        namespace: "team".into(),
        name: "ds".into(),
        key: "team/ds".into(),
        version: version.into(),
        path: format!("{ROOT}/team/ds"),
        state,
        bytes: if state == NodeDatasetState::Ready {
            GIB
        } else {
            0
        },
        bytes_total: GIB,
        placed,
        error: (state == NodeDatasetState::Failed).then(|| "peer reset".into()),
    }
}

fn node(name: &str, agent: Agent) -> ObservedNode {
    ObservedNode {
        name: name.into(),
        labels: BTreeMap::from([("kubernetes.io/hostname".into(), name.into())]),
        ready: true,
        unschedulable: false,
        agent,
    }
}

fn empty(name: &str, free: u64) -> ObservedNode {
    node(name, report(name, free, vec![]))
}

fn key_source(version: &str) -> SourceState {
    SourceState::Key {
        key: "team/ds".into(),
        version: version.into(),
        bytes: GIB,
    }
}

fn observed(
    spec: DatasetSpec,
    status: Option<DatasetStatus>,
    nodes: Vec<ObservedNode>,
    source: SourceState,
) -> Observed {
    Observed {
        dataset: DatasetView {
            namespace: "team".into(),
            name: "ds".into(),
            uid: "uid-1".into(),
            generation: Some(1),
            spec,
            status,
            deleting: false,
        },
        nodes,
        source,
        now: t(0),
    }
}

fn run(obs: &Observed) -> Plan {
    reconcile(obs, &Settings::default())
}

fn seeded_nodes(plan: &Plan) -> Vec<&str> {
    let mut n: Vec<&str> = plan.seeds().into_iter().map(|(n, _)| n).collect();
    n.sort();
    n
}

fn states(plan: &Plan) -> Vec<(String, NodeState)> {
    plan.status
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.state))
        .collect()
}

fn label_of(plan: &Plan, node: &str) -> Option<String> {
    plan.actions.iter().find_map(|a| match a {
        Action::Label { node: n, value } if n == node => Some(value.clone()),
        _ => None,
    })
}

fn unlabelled(plan: &Plan) -> Vec<&str> {
    plan.actions
        .iter()
        .filter_map(|a| match a {
            Action::Unlabel { node } => Some(node.as_str()),
            _ => None,
        })
        .collect()
}

fn unseeded(plan: &Plan) -> Vec<(&str, bool)> {
    plan.actions
        .iter()
        .filter_map(|a| match a {
            Action::Unseed { node, retain } => Some((node.as_str(), *retain)),
            _ => None,
        })
        .collect()
}

fn condition<'a>(plan: &'a Plan, type_: &str) -> &'a Condition {
    plan.status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap()
}

fn with_label(mut n: ObservedNode, value: &str) -> ObservedNode {
    n.labels.insert("data.kt.dev/team.ds".into(), value.into());
    n
}

/// A first seeding picks the nodes with the most free bytes (ties by name)
/// and sends them one broadcast group.
#[test]
fn a_first_seeding_is_one_broadcast_to_the_roomiest_nodes() {
    let obs = observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 2 }"),
        None,
        vec![
            empty("a", 5 * GIB),
            empty("b", 9 * GIB),
            empty("c", 9 * GIB),
        ],
        key_source("v1"),
    );
    let plan = run(&obs);
    assert_eq!(seeded_nodes(&plan), ["b", "c"]);
    let seeds = plan.seeds();
    let groups: Vec<_> = seeds
        .iter()
        .map(|(_, r)| r.broadcast.clone().unwrap())
        .collect();
    assert_eq!(groups[0], groups[1], "one group for all");
    assert_eq!(groups[0].fanout, 1);
    assert_eq!(groups[0].window_ms, 5000);
    assert!(groups[0].group.contains("uid-1") && groups[0].group.contains("v1"));
    assert_eq!(
        *seeds[0].1,
        SeedRequest {
            key: "team/ds".into(),
            version: "v1".into(),
            path: format!("{ROOT}/team/ds"),
            bytes: GIB,
            broadcast: Some(groups[0].clone()),
        }
    );
    assert_eq!(plan.status.phase, Phase::Seeding);
    assert_eq!(plan.status.desired_nodes, 2);
    assert_eq!(plan.status.ready_nodes, 0);
    assert_eq!(plan.status.version.as_deref(), Some("v1"));
    assert_eq!(plan.status.label.as_deref(), Some("data.kt.dev/team.ds"));
    assert_eq!(plan.status.observed_generation, Some(1));
    assert_eq!(
        states(&plan),
        [
            ("b".into(), NodeState::Seeding),
            ("c".into(), NodeState::Seeding)
        ]
    );
    assert!(condition(&plan, SOURCE_READY).status == "True");
    assert!(condition(&plan, PLACED).status == "True");
    assert!(condition(&plan, READY).status == "False");
    assert_eq!(plan.requeue, Settings::default().busy_requeue);
    assert!(
        plan.actions
            .iter()
            .all(|a| !matches!(a, Action::Label { .. })),
        "no label before Ready"
    );
}

/// Seeding once more (no answer yet) sends nothing new; a node whose agent
/// holds the version Ready is labelled, and all Ready makes the phase Ready.
#[test]
fn nodes_are_labelled_once_they_hold_the_version() {
    let first = run(&observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 2 }"),
        None,
        vec![
            empty("a", 9 * GIB),
            empty("b", 9 * GIB),
            empty("c", GIB / 2),
        ],
        key_source("v1"),
    ));
    let seeding = observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 2 }"),
        Some(first.status.clone()),
        vec![
            node(
                "a",
                report(
                    "a",
                    8 * GIB,
                    vec![held("v1", NodeDatasetState::Ready, true)],
                ),
            ),
            node(
                "b",
                report(
                    "b",
                    8 * GIB,
                    vec![held("v1", NodeDatasetState::Seeding, true)],
                ),
            ),
            empty("c", GIB / 2),
        ],
        key_source("v1"),
    );
    let plan = run(&seeding);
    assert!(
        plan.seeds().is_empty(),
        "nothing sent twice: {:?}",
        plan.actions
    );
    assert_eq!(label_of(&plan, "a").as_deref(), Some("v1"));
    assert_eq!(label_of(&plan, "b"), None);
    assert_eq!(plan.status.phase, Phase::Seeding);
    assert_eq!(plan.status.ready_nodes, 1);

    let mut ready = seeding.clone();
    ready.dataset.status = Some(plan.status.clone());
    ready.nodes[0] = with_label(ready.nodes[0].clone(), "v1");
    ready.nodes[1] = node(
        "b",
        report(
            "b",
            8 * GIB,
            vec![held("v1", NodeDatasetState::Ready, true)],
        ),
    );
    let plan2 = run(&ready);
    assert_eq!(label_of(&plan2, "a"), None, "already labelled");
    assert_eq!(label_of(&plan2, "b").as_deref(), Some("v1"));
    assert_eq!(plan2.status.phase, Phase::Ready);
    assert_eq!(plan2.status.ready_nodes, 2);
    assert_eq!(condition(&plan2, READY).status, "True");
    assert_eq!(plan2.requeue, Settings::default().ready_requeue);
    assert!(
        plan2
            .events()
            .iter()
            .any(|e| e.reason == "Ready" && e.type_ == EventType::Normal)
    );

    // Nothing changed: the same status, no action, no event.
    let mut same = ready.clone();
    same.dataset.status = Some(plan2.status.clone());
    same.nodes[1] = with_label(same.nodes[1].clone(), "v1");
    same.now = t(100);
    let plan3 = run(&same);
    assert!(plan3.actions.is_empty(), "{:?}", plan3.actions);
    assert_eq!(plan3.status, plan2.status, "lastTransitionTime kept");
}

/// Nodes must be Ready, schedulable, selected, with a reachable agent and
/// room for the version.
#[test]
fn candidates_must_fit_the_placement() {
    let mut not_ready = empty("a", 9 * GIB);
    not_ready.ready = false;
    let mut cordoned = empty("b", 9 * GIB);
    cordoned.unschedulable = true;
    let mut gpu = empty("c", 2 * GIB);
    gpu.labels.insert("gpu".into(), "a100".into());
    gpu.labels.insert("zone".into(), "z1".into());
    let mut gpu_far = empty("d", 9 * GIB);
    gpu_far.labels.insert("gpu".into(), "a100".into());
    gpu_far.labels.insert("zone".into(), "z9".into());
    let mut gpu_full = empty("e", GIB / 2);
    gpu_full.labels.insert("gpu".into(), "a100".into());
    let mut gpu_no_agent = node("f", Agent::None);
    gpu_no_agent.labels.insert("gpu".into(), "a100".into());
    let mut gpu_unreachable = node("g", Agent::Unreachable("refused".into()));
    gpu_unreachable.labels.insert("gpu".into(), "a100".into());
    let plan = run(&observed(
        spec(
            "source: { key: team/ds }\nplacement:\n  replicas: 3\n  nodeSelector: { gpu: a100 }\n  matchExpressions: [{ key: zone, operator: NotIn, values: [z9] }]",
        ),
        None,
        vec![
            not_ready,
            cordoned,
            gpu,
            gpu_far,
            gpu_full,
            gpu_no_agent,
            gpu_unreachable,
        ],
        key_source("v1"),
    ));
    assert_eq!(seeded_nodes(&plan), ["c"]);
    assert!(
        plan.seeds()[0].1.broadcast.is_none(),
        "one node: an ordinary get"
    );
    assert_eq!(plan.status.phase, Phase::Seeding);
    assert_eq!(plan.status.reason.as_deref(), Some("InsufficientNodes"));
    let placed = condition(&plan, PLACED);
    assert_eq!(placed.status, "False");
    assert!(
        placed.message.contains("1 of 3") && placed.message.contains("only 2"),
        "{}",
        placed.message
    );
    assert!(
        plan.events()
            .iter()
            .any(|e| e.reason == "InsufficientNodes" && e.type_ == EventType::Warning)
    );
}

#[test]
fn too_little_room_is_insufficient_capacity_and_pending() {
    let plan = run(&observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 2 }"),
        None,
        vec![empty("a", GIB / 2), empty("b", GIB / 4)],
        key_source("v1"),
    ));
    assert!(plan.seeds().is_empty());
    assert_eq!(plan.status.phase, Phase::Pending);
    assert_eq!(plan.status.reason.as_deref(), Some("InsufficientCapacity"));
    let m = &condition(&plan, PLACED).message;
    assert!(m.contains("0 of 2") && m.contains(&GIB.to_string()), "{m}");
}

/// Nodes holding the version (even unplaced, retained) or an older one are
/// preferred over roomier ones.
#[test]
fn nodes_holding_the_data_are_preferred() {
    let plan = run(&observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 2 }"),
        None,
        vec![
            empty("a", 50 * GIB),
            node(
                "b",
                report(
                    "b",
                    2 * GIB,
                    vec![held("v0", NodeDatasetState::Ready, false)],
                ),
            ),
            node(
                "c",
                report(
                    "c",
                    2 * GIB,
                    vec![held("v1", NodeDatasetState::Ready, false)],
                ),
            ),
        ],
        key_source("v1"),
    ));
    assert_eq!(seeded_nodes(&plan), ["b", "c"]);
}

/// A member whose agent became unreachable is Lost, unlabelled and replaced
/// (by an ordinary get: the survivors hold the version); the status says
/// which node replaced which.
#[test]
fn a_lost_node_is_replaced_and_status_says_so() {
    let sp = spec("source: { key: team/ds }\nplacement: { replicas: 2 }");
    let ready = |n: &str| {
        with_label(
            node(
                n,
                report(n, 8 * GIB, vec![held("v1", NodeDatasetState::Ready, true)]),
            ),
            "v1",
        )
    };
    let before = run(&observed(
        sp.clone(),
        None,
        vec![ready("a"), ready("b"), empty("c", 9 * GIB)],
        key_source("v1"),
    ));
    assert_eq!(before.status.phase, Phase::Ready);
    let mut lost_b = ready("b");
    lost_b.agent = Agent::Unreachable("connection refused".into());
    let plan = run(&observed(
        sp.clone(),
        Some(before.status.clone()),
        vec![ready("a"), lost_b, empty("c", 9 * GIB)],
        key_source("v1"),
    ));
    assert_eq!(seeded_nodes(&plan), ["c"]);
    assert!(plan.seeds()[0].1.broadcast.is_none());
    assert_eq!(unlabelled(&plan), ["b"]);
    assert!(
        unseeded(&plan).is_empty(),
        "an unreachable agent is not called"
    );
    let b = plan.status.nodes.iter().find(|n| n.name == "b").unwrap();
    assert_eq!(b.state, NodeState::Lost);
    assert!(b.message.as_deref().unwrap().contains("unreachable"));
    let c = plan.status.nodes.iter().find(|n| n.name == "c").unwrap();
    assert_eq!(c.state, NodeState::Seeding);
    assert!(
        c.message.as_deref().unwrap().contains("replaces node b"),
        "{c:?}"
    );
    assert!(plan.events().iter().any(|e| e.reason == "NodeLost"));
    assert!(
        plan.events()
            .iter()
            .any(|e| e.reason == "NodeReplaced" && e.message.contains("node c replaces node b"))
    );
    assert_eq!(plan.status.phase, Phase::Seeding);

    // The lost agent comes back: it is out of the placement, so it lets go.
    let mut back = observed(
        sp,
        Some(plan.status.clone()),
        vec![
            ready("a"),
            node(
                "b",
                report(
                    "b",
                    8 * GIB,
                    vec![held("v1", NodeDatasetState::Ready, true)],
                ),
            ),
            node(
                "c",
                report(
                    "c",
                    8 * GIB,
                    vec![held("v1", NodeDatasetState::Ready, true)],
                ),
            ),
        ],
        key_source("v1"),
    );
    back.now = t(10);
    let plan2 = run(&back);
    assert_eq!(unseeded(&plan2), [("b", false)]);
    assert_eq!(label_of(&plan2, "c").as_deref(), Some("v1"));
    assert_eq!(plan2.status.phase, Phase::Ready);
    assert!(
        plan2
            .status
            .nodes
            .iter()
            .any(|n| n.name == "b" && n.state == NodeState::Removing)
    );
}

/// A node lost while the first broadcast is under way: the survivors go
/// on, the replacement gets an ordinary get.
#[test]
fn node_loss_mid_seed() {
    let sp = spec("source: { key: team/ds }\nplacement: { replicas: 3 }");
    let first = run(&observed(
        sp.clone(),
        None,
        vec![
            empty("a", 9 * GIB),
            empty("b", 9 * GIB),
            empty("c", 9 * GIB),
            empty("d", 2 * GIB),
        ],
        key_source("v1"),
    ));
    assert_eq!(seeded_nodes(&first), ["a", "b", "c"]);
    let seeding = |n: &str| {
        node(
            n,
            report(
                n,
                8 * GIB,
                vec![held("v1", NodeDatasetState::Seeding, true)],
            ),
        )
    };
    let plan = run(&observed(
        sp,
        Some(first.status.clone()),
        vec![seeding("a"), seeding("c"), empty("d", 2 * GIB)],
        key_source("v1"),
    ));
    assert_eq!(seeded_nodes(&plan), ["d"]);
    assert!(plan.seeds()[0].1.broadcast.is_none());
    let b = plan.status.nodes.iter().find(|n| n.name == "b").unwrap();
    assert_eq!(b.state, NodeState::Lost);
    assert!(b.message.as_deref().unwrap().contains("node b is gone"));
    assert_eq!(plan.status.phase, Phase::Seeding);
    assert_eq!(plan.status.reason.as_deref(), Some("Seeding"));
}

#[test]
fn a_not_ready_node_is_lost() {
    let sp = spec("source: { key: team/ds }\nplacement: { replicas: 1 }");
    let first = run(&observed(
        sp.clone(),
        None,
        vec![empty("a", 9 * GIB), empty("b", 2 * GIB)],
        key_source("v1"),
    ));
    let mut a = with_label(
        node(
            "a",
            report(
                "a",
                8 * GIB,
                vec![held("v1", NodeDatasetState::Ready, true)],
            ),
        ),
        "v1",
    );
    a.ready = false;
    let plan = run(&observed(
        sp,
        Some(first.status),
        vec![a, empty("b", 2 * GIB)],
        key_source("v1"),
    ));
    assert_eq!(seeded_nodes(&plan), ["b"]);
    assert_eq!(unlabelled(&plan), ["a"]);
    assert!(states(&plan).contains(&("a".into(), NodeState::Lost)));
}

/// A failed seed: the node is Failed, its copy let go, another node seeded;
/// a later choice tries it last.
#[test]
fn a_failed_seed_is_replaced_and_retried_later() {
    let sp = spec("source: { key: team/ds }\nplacement: { replicas: 1 }");
    let first = run(&observed(
        sp.clone(),
        None,
        vec![empty("a", 9 * GIB), empty("b", 2 * GIB)],
        key_source("v1"),
    ));
    assert_eq!(seeded_nodes(&first), ["a"]);
    let plan = run(&observed(
        sp.clone(),
        Some(first.status.clone()),
        vec![
            node(
                "a",
                report(
                    "a",
                    9 * GIB,
                    vec![held("v1", NodeDatasetState::Failed, true)],
                ),
            ),
            empty("b", 2 * GIB),
        ],
        key_source("v1"),
    ));
    assert_eq!(seeded_nodes(&plan), ["b"]);
    assert_eq!(unseeded(&plan), [("a", false)]);
    let a = plan.status.nodes.iter().find(|n| n.name == "a").unwrap();
    assert_eq!(a.state, NodeState::Failed);
    assert!(a.message.as_deref().unwrap().contains("peer reset"));
    assert!(
        plan.events()
            .iter()
            .any(|e| e.reason == "SeedFailed" && e.type_ == EventType::Warning)
    );
    assert!(plan.events().iter().any(|e| e.reason == "NodeReplaced"));

    // Later b leaves; a is tried again (it is the only one left).
    let plan2 = run(&observed(
        sp,
        Some(plan.status.clone()),
        vec![empty("a", 9 * GIB)],
        key_source("v1"),
    ));
    assert_eq!(seeded_nodes(&plan2), ["a"]);
}

/// Scale down: the extra members (not Ready first, then from the end) are
/// unlabelled and unseeded per the reclaim policy.
#[test]
fn scale_down_removes_the_extra_nodes() {
    let ready = |n: &str| {
        with_label(
            node(
                n,
                report(n, 8 * GIB, vec![held("v1", NodeDatasetState::Ready, true)]),
            ),
            "v1",
        )
    };
    let three = run(&observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 3 }"),
        None,
        vec![ready("a"), ready("b"), ready("c")],
        key_source("v1"),
    ));
    assert_eq!(three.status.ready_nodes, 3);
    let plan = run(&observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 1 }\nreclaimPolicy: Retain"),
        Some(three.status.clone()),
        vec![ready("a"), ready("b"), ready("c")],
        key_source("v1"),
    ));
    assert_eq!(unseeded(&plan), [("b", true), ("c", true)]);
    assert_eq!(unlabelled(&plan), ["b", "c"]);
    assert_eq!(plan.status.phase, Phase::Ready);
    assert_eq!(plan.status.ready_nodes, 1);
    assert_eq!(
        states(&plan),
        [
            ("a".into(), NodeState::Ready),
            ("b".into(), NodeState::Removing),
            ("c".into(), NodeState::Removing)
        ]
    );
    // Once the agents let go (retained: placed false), they leave the status.
    let unplaced = |n: &str| {
        node(
            n,
            report(n, 8 * GIB, vec![held("v1", NodeDatasetState::Ready, false)]),
        )
    };
    let plan2 = run(&observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 1 }\nreclaimPolicy: Retain"),
        Some(plan.status.clone()),
        vec![ready("a"), unplaced("b"), unplaced("c")],
        key_source("v1"),
    ));
    assert!(unseeded(&plan2).is_empty());
    assert_eq!(states(&plan2), [("a".into(), NodeState::Ready)]);
}

/// A node no longer selected leaves the placement; another takes its place.
#[test]
fn a_selector_change_moves_the_data() {
    let mut a = with_label(
        node(
            "a",
            report(
                "a",
                8 * GIB,
                vec![held("v1", NodeDatasetState::Ready, true)],
            ),
        ),
        "v1",
    );
    a.labels.insert("pool".into(), "old".into());
    let mut b = empty("b", 8 * GIB);
    b.labels.insert("pool".into(), "new".into());
    let before = run(&observed(
        spec("source: { key: team/ds }"),
        None,
        vec![a.clone(), b.clone()],
        key_source("v1"),
    ));
    assert_eq!(before.status.phase, Phase::Ready);
    let plan = run(&observed(
        spec("source: { key: team/ds }\nplacement: { nodeSelector: { pool: new } }"),
        Some(before.status),
        vec![a, b],
        key_source("v1"),
    ));
    assert_eq!(seeded_nodes(&plan), ["b"]);
    assert_eq!(unseeded(&plan), [("a", false)]);
    assert_eq!(unlabelled(&plan), ["a"]);
}

/// A new version goes to the placed nodes as one broadcast; labels stay on
/// the old version until a node holds the new one.
#[test]
fn a_new_version_moves_labels_only_once_held() {
    let sp = spec("source: { key: team/ds }\nplacement: { replicas: 2 }");
    let on =
        |n: &str, v: &str, s: NodeDatasetState| node(n, report(n, 8 * GIB, vec![held(v, s, true)]));
    let v1 = run(&observed(
        sp.clone(),
        None,
        vec![
            with_label(on("a", "v1", NodeDatasetState::Ready), "v1"),
            with_label(on("b", "v1", NodeDatasetState::Ready), "v1"),
            empty("c", 50 * GIB),
        ],
        key_source("v1"),
    ));
    assert_eq!(v1.status.phase, Phase::Ready);
    let plan = run(&observed(
        sp.clone(),
        Some(v1.status.clone()),
        vec![
            with_label(on("a", "v1", NodeDatasetState::Ready), "v1"),
            with_label(on("b", "v1", NodeDatasetState::Ready), "v1"),
            empty("c", 50 * GIB),
        ],
        key_source("v2"),
    ));
    assert_eq!(
        seeded_nodes(&plan),
        ["a", "b"],
        "the placed nodes, not the roomier c"
    );
    let seeds = plan.seeds();
    assert!(
        seeds
            .iter()
            .all(|(_, r)| r.version == "v2" && r.broadcast.is_some())
    );
    assert!(unlabelled(&plan).is_empty());
    assert!(
        plan.actions
            .iter()
            .all(|a| !matches!(a, Action::Label { .. }))
    );
    assert_eq!(plan.status.phase, Phase::Seeding);
    assert_eq!(plan.status.version.as_deref(), Some("v2"));

    // a holds v2, b still fetches it: a's label moves, b's stays on v1.
    let plan2 = run(&observed(
        sp,
        Some(plan.status.clone()),
        vec![
            with_label(on("a", "v2", NodeDatasetState::Ready), "v1"),
            with_label(on("b", "v2", NodeDatasetState::Seeding), "v1"),
            empty("c", 50 * GIB),
        ],
        key_source("v2"),
    ));
    assert!(plan2.seeds().is_empty());
    assert_eq!(label_of(&plan2, "a").as_deref(), Some("v2"));
    assert_eq!(label_of(&plan2, "b"), None);
    assert!(unlabelled(&plan2).is_empty());
}

/// A bad source ends Failed at once with one Warning event, and is looked
/// at again only after the long requeue.
#[test]
fn a_missing_key_fails_at_once_without_a_storm() {
    let sp = spec("source: { key: team/nope }");
    let plan = run(&observed(
        sp.clone(),
        None,
        vec![empty("a", 9 * GIB)],
        SourceState::NotFound("key team/nope not found".into()),
    ));
    assert_eq!(plan.status.phase, Phase::Failed);
    assert_eq!(plan.status.reason.as_deref(), Some("KeyNotFound"));
    assert!(plan.seeds().is_empty());
    let events = plan.events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].type_, EventType::Warning);
    assert_eq!(events[0].reason, "KeyNotFound");
    assert!(events[0].message.contains("team/nope"));
    assert_eq!(condition(&plan, SOURCE_READY).reason, "KeyNotFound");
    assert_eq!(plan.requeue, Settings::default().failed_requeue);
    // Looked at again: still failed, no second event.
    let again = run(&observed(
        sp,
        Some(plan.status.clone()),
        vec![empty("a", 9 * GIB)],
        SourceState::NotFound("key team/nope not found".into()),
    ));
    assert!(again.events().is_empty());
    assert_eq!(again.status, plan.status);
}

#[test]
fn a_bad_path_fails() {
    let plan = run(&observed(
        spec("source: { key: team/ds }\npath: /var/lib/kt/datasets/../etc"),
        None,
        vec![empty("a", 9 * GIB)],
        key_source("v1"),
    ));
    assert_eq!(plan.status.phase, Phase::Failed);
    assert_eq!(plan.status.reason.as_deref(), Some("InvalidPath"));
    let outside = run(&observed(
        spec("source: { key: team/ds }\npath: /etc/ds"),
        None,
        vec![empty("a", 9 * GIB)],
        key_source("v1"),
    ));
    assert_eq!(outside.status.reason.as_deref(), Some("InvalidPath"));
    assert!(outside.seeds().is_empty());
    let custom = run(&observed(
        spec("source: { key: team/ds }\npath: /var/lib/kt/datasets/shared/imagenet"),
        None,
        vec![empty("a", 9 * GIB)],
        key_source("v1"),
    ));
    assert_eq!(
        custom.seeds()[0].1.path,
        "/var/lib/kt/datasets/shared/imagenet"
    );
}

#[test]
fn a_source_that_cannot_be_asked_now_waits() {
    let plan = run(&observed(
        spec("source: { key: team/ds }"),
        None,
        vec![empty("a", 9 * GIB)],
        SourceState::Unavailable("connection refused".into()),
    ));
    assert_eq!(plan.status.phase, Phase::Pending);
    assert_eq!(plan.status.reason.as_deref(), Some("SourceUnavailable"));
    assert_eq!(plan.requeue, Settings::default().busy_requeue);
    assert!(plan.events().is_empty());
}

fn s3_spec() -> DatasetSpec {
    spec(
        "source: { s3: { bucket: b, prefix: train/ } }\nrefresh: { interval: 10m }\nplacement: { replicas: 2 }",
    )
}

/// S3: no ingest yet starts one (Ingesting); a finished one is placed; the
/// interval's end starts another while the nodes keep the old version.
#[test]
fn s3_sources_are_ingested_then_placed_then_refreshed() {
    let nodes = || vec![empty("a", 9 * GIB), empty("b", 9 * GIB)];
    let start = run(&observed(
        s3_spec(),
        None,
        nodes(),
        SourceState::Ingest(IngestState::NotStarted),
    ));
    assert!(start.actions.contains(&Action::Ingest));
    assert_eq!(start.status.phase, Phase::Ingesting);
    assert!(start.seeds().is_empty());
    let running = run(&observed(
        s3_spec(),
        Some(start.status.clone()),
        nodes(),
        SourceState::Ingest(IngestState::Running {
            progress: IngestStatus {
                objects: 10,
                bytes: 100,
                changed: 3,
                ..Default::default()
            },
        }),
    ));
    assert!(!running.actions.contains(&Action::Ingest));
    assert_eq!(running.status.phase, Phase::Ingesting);
    assert_eq!(running.status.ingest.as_ref().unwrap().objects, 10);
    let done = |finished: SystemTime| {
        SourceState::Ingest(IngestState::Done {
            source: s3_spec().source,
            key: "datasets/team/ds".into(),
            version: "v1".into(),
            bytes: GIB,
            status: IngestStatus {
                objects: 10,
                bytes: GIB,
                changed: 10,
                ..Default::default()
            },
            finished,
        })
    };
    let placed = run(&observed(
        s3_spec(),
        Some(running.status.clone()),
        nodes(),
        done(t(0)),
    ));
    assert!(!placed.actions.contains(&Action::Ingest));
    assert_eq!(seeded_nodes(&placed), ["a", "b"]);
    assert_eq!(placed.seeds()[0].1.key, "datasets/team/ds");
    assert_eq!(placed.status.phase, Phase::Seeding);
    assert_eq!(condition(&placed, SOURCE_READY).reason, "Ingested");

    let mut later = observed(s3_spec(), Some(placed.status.clone()), nodes(), done(t(0)));
    later.now = t(601);
    let refresh = run(&later);
    assert!(
        refresh.actions.contains(&Action::Ingest),
        "the interval is over"
    );
    // While it runs, the nodes keep the version they have.
    let mut during = observed(
        s3_spec(),
        Some(placed.status.clone()),
        vec![
            node(
                "a",
                report(
                    "a",
                    8 * GIB,
                    vec![held("v1", NodeDatasetState::Seeding, true)],
                ),
            ),
            node(
                "b",
                report(
                    "b",
                    8 * GIB,
                    vec![held("v1", NodeDatasetState::Seeding, true)],
                ),
            ),
        ],
        SourceState::Ingest(IngestState::Running {
            progress: IngestStatus::default(),
        }),
    );
    during.now = t(602);
    let plan = run(&during);
    assert_eq!(plan.status.version.as_deref(), Some("v1"));
    assert!(
        plan.seeds().is_empty(),
        "the agents fetch v1 already (status)"
    );
    // Nothing wakes the controller when the ingest ends: it looks again
    // soon, not at the (long) Ready requeue.
    assert_eq!(plan.requeue, Settings::default().busy_requeue);
}

/// A failed ingest fails the Dataset; it is retried after the back-off, or
/// at once when the source changes.
#[test]
fn a_failed_ingest_is_retried_after_the_back_off() {
    let failed = |source| {
        SourceState::Ingest(IngestState::Failed {
            source,
            reason: "IngestFailed".into(),
            message: "bucket b: access denied".into(),
            at: t(0),
        })
    };
    let plan = run(&observed(
        s3_spec(),
        None,
        vec![empty("a", 9 * GIB)],
        failed(s3_spec().source),
    ));
    assert_eq!(plan.status.phase, Phase::Failed);
    assert_eq!(plan.status.reason.as_deref(), Some("IngestFailed"));
    assert!(!plan.actions.contains(&Action::Ingest));
    assert_eq!(plan.events().len(), 1);
    let mut later = observed(
        s3_spec(),
        Some(plan.status.clone()),
        vec![empty("a", 9 * GIB)],
        failed(s3_spec().source),
    );
    later.now = t(Settings::default().failed_requeue.as_secs());
    assert!(run(&later).actions.contains(&Action::Ingest));
    let other = spec("source: { s3: { bucket: other } }").source;
    let changed = run(&observed(
        s3_spec(),
        Some(plan.status.clone()),
        vec![empty("a", 9 * GIB)],
        failed(other),
    ));
    assert!(changed.actions.contains(&Action::Ingest));
}

#[test]
fn a_bad_refresh_interval_fails() {
    let plan = run(&observed(
        spec("source: { key: team/ds }\nrefresh: { interval: often }"),
        None,
        vec![empty("a", 9 * GIB)],
        key_source("v1"),
    ));
    assert_eq!(plan.status.phase, Phase::Failed);
    assert_eq!(plan.status.reason.as_deref(), Some("InvalidRefresh"));
}

/// Deletion: unlabel and unseed everywhere, then the finalizer goes.
#[test]
fn deletion_cleans_up_then_removes_the_finalizer() {
    let ready = |n: &str| {
        with_label(
            node(
                n,
                report(n, 8 * GIB, vec![held("v1", NodeDatasetState::Ready, true)]),
            ),
            "v1",
        )
    };
    let mut unreachable = ready("c");
    unreachable.agent = Agent::Unreachable("timeout".into());
    let mut obs = observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 2 }"),
        None,
        vec![ready("a"), ready("b"), unreachable],
        key_source("v1"),
    );
    obs.dataset.deleting = true;
    let plan = run(&obs);
    assert_eq!(unseeded(&plan), [("a", false), ("b", false)]);
    assert_eq!(unlabelled(&plan), ["a", "b", "c"]);
    assert!(!plan.actions.contains(&Action::RemoveFinalizer));
    obs.nodes = vec![
        empty("a", 9 * GIB),
        empty("b", 9 * GIB),
        node("c", Agent::Unreachable("timeout".into())),
    ];
    let done = run(&obs);
    assert_eq!(done.actions, [Action::RemoveFinalizer]);
}

/// Deletion of an ingested Dataset: a running ingest is stopped first;
/// with `reclaimPolicy: Delete` the ingested key goes right before the
/// finalizer, never while an ingest runs; `Retain` keeps it, and a key
/// source (the user's) is never deleted.
#[test]
fn deletion_deletes_the_ingested_key_per_the_reclaim_policy() {
    let running = SourceState::Ingest(IngestState::Running {
        progress: IngestStatus::default(),
    });
    let idle = SourceState::Ingest(IngestState::NotStarted);
    let key = || Action::DeleteIngested {
        key: "datasets/team/ds".into(),
    };
    for source in [
        "source: { s3: { bucket: b, prefix: train/ } }",
        "source: { pvc: { claimName: data } }",
    ] {
        let mut obs = observed(
            spec(source),
            None,
            vec![empty("a", 9 * GIB)],
            running.clone(),
        );
        obs.dataset.deleting = true;
        let plan = run(&obs);
        assert_eq!(plan.actions, [Action::StopIngest], "{source}");
        obs.source = idle.clone();
        assert_eq!(
            run(&obs).actions,
            [key(), Action::RemoveFinalizer],
            "{source}"
        );
        // Nodes still holding it: neither the key nor the finalizer yet.
        obs.nodes = vec![node(
            "a",
            report("a", GIB, vec![held("v1", NodeDatasetState::Ready, true)]),
        )];
        assert!(!run(&obs).actions.contains(&key()), "{source}");
        let mut retained = obs.clone();
        retained.dataset.spec.reclaim_policy = ReclaimPolicy::Retain;
        retained.nodes = vec![empty("a", 9 * GIB)];
        assert_eq!(
            run(&retained).actions,
            [Action::RemoveFinalizer],
            "{source}"
        );
    }
    // A key source, even one named like an ingested key, is the user's.
    let mut obs = observed(
        spec("source: { key: datasets/team/ds }"),
        None,
        vec![empty("a", 9 * GIB)],
        key_source("v1"),
    );
    obs.dataset.deleting = true;
    assert_eq!(run(&obs).actions, [Action::RemoveFinalizer]);
}

#[test]
fn a_status_write_that_was_lost_is_recovered_from_the_agents() {
    // No status, but the agents hold it placed: they are the members.
    let plan = run(&observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 1 }"),
        None,
        vec![
            empty("a", 90 * GIB),
            node(
                "b",
                report("b", GIB, vec![held("v1", NodeDatasetState::Seeding, true)]),
            ),
        ],
        key_source("v1"),
    ));
    assert!(plan.seeds().is_empty(), "{:?}", plan.actions);
    assert_eq!(states(&plan), [("b".into(), NodeState::Seeding)]);
}

#[test]
fn selectors_and_label_values() {
    let labels = BTreeMap::from([("gpu".to_owned(), "a100".to_owned())]);
    let expr = |op, values: &[&str]| NodeSelectorRequirement {
        key: "gpu".into(),
        operator: op,
        values: values.iter().map(|s| s.to_string()).collect(),
    };
    use crate::crd::SelectorOperator::*;
    assert!(selects(
        &BTreeMap::new(),
        &[expr(In, &["a100", "h100"])],
        &labels
    ));
    assert!(!selects(
        &BTreeMap::new(),
        &[expr(NotIn, &["a100"])],
        &labels
    ));
    assert!(selects(&BTreeMap::new(), &[expr(Exists, &[])], &labels));
    assert!(!selects(
        &BTreeMap::new(),
        &[expr(DoesNotExist, &[])],
        &labels
    ));
    assert!(selects(
        &BTreeMap::new(),
        &[expr(NotIn, &["a100"])],
        &BTreeMap::new()
    ));
    assert_eq!(label_value("v-1.2_3"), "v-1.2_3");
    assert_eq!(label_value("sha256:abc/def"), "sha256-abc-def");
    assert_eq!(label_value(&"x".repeat(80)).len(), 63);
}

/// The same input gives the same plan (the broadcast group included).
#[test]
fn reconcile_is_deterministic() {
    let obs = observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 3 }"),
        None,
        vec![
            empty("c", 9 * GIB),
            empty("a", 9 * GIB),
            empty("b", 9 * GIB),
            empty("d", 9 * GIB),
        ],
        key_source("v1"),
    );
    assert_eq!(run(&obs), run(&obs));
    assert_eq!(seeded_nodes(&run(&obs)), ["a", "b", "c"]);
}

/// A node-cache agent that claims to hold a dataset it was never given
/// does not push out a node the controller placed (it is the one to go).
#[test]
fn an_agent_claiming_a_dataset_it_was_not_given_is_the_one_removed() {
    let ready = |n: &str| {
        with_label(
            node(
                n,
                report(n, 8 * GIB, vec![held("v1", NodeDatasetState::Ready, true)]),
            ),
            "v1",
        )
    };
    let one = run(&observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 1 }"),
        None,
        vec![ready("m"), empty("a", GIB)],
        key_source("v1"),
    ));
    assert_eq!(states(&one), [("m".into(), NodeState::Ready)]);
    // Node "a" (first by name) now claims it holds the dataset Ready.
    let liar = node(
        "a",
        report(
            "a",
            99 * GIB,
            vec![held("v1", NodeDatasetState::Ready, true)],
        ),
    );
    let plan = run(&observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 1 }"),
        Some(one.status.clone()),
        vec![ready("m"), liar],
        key_source("v1"),
    ));
    assert_eq!(unseeded(&plan), [("a", false)]);
    assert!(unlabelled(&plan).is_empty(), "{:?}", plan.actions);
    assert!(label_of(&plan, "a").is_none());
    assert_eq!(
        states(&plan),
        [
            ("a".into(), NodeState::Removing),
            ("m".into(), NodeState::Ready)
        ]
    );
}

/// A name too long for a node label key fails the Dataset, labelling
/// nothing; label values are always valid label values.
#[test]
fn names_that_make_no_label_fail_and_label_values_are_valid() {
    let mut obs = observed(
        spec("source: { key: team/ds }"),
        None,
        vec![empty("a", 9 * GIB)],
        key_source("v1"),
    );
    obs.dataset.name = format!("{}.{}", "x".repeat(40), "y".repeat(40));
    let plan = run(&obs);
    assert_eq!(plan.status.phase, Phase::Failed);
    assert_eq!(plan.status.reason.as_deref(), Some("InvalidName"));
    assert!(plan.seeds().is_empty(), "{:?}", plan.actions);
    assert!(label_key_problem(&node_label("team", "ds")).is_none());
    assert!(label_key_problem(&node_label(&"n".repeat(30), &"d".repeat(32))).is_none());
    assert!(label_key_problem(&node_label(&"n".repeat(30), &"d".repeat(33))).is_some());
    let valid = |v: &str| {
        v.len() <= 63
            && v.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
            && (v.is_empty()
                || (v.starts_with(|c: char| c.is_ascii_alphanumeric())
                    && v.ends_with(|c: char| c.is_ascii_alphanumeric())))
    };
    for v in [
        "v1",
        "-._",
        "ümlaut-é",
        "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        &format!("{}-{}", "a".repeat(62), "b"),
        "2026-11-28T07:00:00Z",
        " ",
    ] {
        let l = label_value(v);
        assert!(valid(&l), "{v:?} -> {l:?}");
    }
}

/// An ingest whose put found the metadata server away is no failure: a
/// Ready dataset stays Ready on the version its nodes hold (no Failed
/// flapping, no event storm), a new one waits Pending; both retry soon.
#[test]
fn an_ingest_that_found_the_store_away_waits_instead_of_failing() {
    let ready = |n: &str| {
        with_label(
            node(
                n,
                report(n, 8 * GIB, vec![held("v1", NodeDatasetState::Ready, true)]),
            ),
            "v1",
        )
    };
    let unavailable = SourceState::Ingest(IngestState::Failed {
        source: s3_spec().source,
        reason: SOURCE_UNAVAILABLE.into(),
        message: "putting s3://b/train/ into datasets/team/ds: connection refused".into(),
        at: t(0),
    });
    let prev = DatasetStatus {
        key: Some("datasets/team/ds".into()),
        version: Some("v1".into()),
        bytes: Some(GIB),
        ..run(&observed(
            s3_spec(),
            None,
            vec![ready("a"), ready("b")],
            SourceState::Ingest(IngestState::Done {
                source: s3_spec().source,
                key: "datasets/team/ds".into(),
                version: "v1".into(),
                bytes: GIB,
                status: IngestStatus::default(),
                finished: t(0),
            }),
        ))
        .status
    };
    assert_eq!(prev.phase, Phase::Ready);
    let mut obs = observed(
        s3_spec(),
        Some(prev.clone()),
        vec![ready("a"), ready("b")],
        unavailable.clone(),
    );
    obs.now = t(1);
    let plan = run(&obs);
    assert_eq!(plan.status.phase, Phase::Ready, "{:?}", plan.status);
    assert_eq!(plan.status.ready_nodes, 2);
    assert!(plan.events().is_empty(), "{:?}", plan.events());
    assert!(!plan.actions.contains(&Action::Ingest));
    assert!(unlabelled(&plan).is_empty() && unseeded(&plan).is_empty());
    assert_eq!(condition(&plan, SOURCE_READY).reason, SOURCE_UNAVAILABLE);
    assert!(plan.requeue <= UNAVAILABLE_RETRY);
    obs.now = t(UNAVAILABLE_RETRY.as_secs());
    assert!(run(&obs).actions.contains(&Action::Ingest));

    let fresh = run(&observed(
        s3_spec(),
        None,
        vec![empty("a", 9 * GIB)],
        unavailable,
    ));
    assert_eq!(fresh.status.phase, Phase::Pending);
    assert_eq!(fresh.status.reason.as_deref(), Some(SOURCE_UNAVAILABLE));
    assert!(fresh.seeds().is_empty());
}

/// A controller that restarted mid-seed (its status write lost) does not
/// broadcast again: the node already fetching keeps fetching, the one the
/// lost round never reached gets an ordinary get.
#[test]
fn a_restart_mid_seed_does_not_broadcast_twice() {
    let plan = run(&observed(
        spec("source: { key: team/ds }\nplacement: { replicas: 2 }"),
        None,
        vec![
            node(
                "a",
                report(
                    "a",
                    9 * GIB,
                    vec![held("v1", NodeDatasetState::Seeding, true)],
                ),
            ),
            empty("b", 9 * GIB),
        ],
        key_source("v1"),
    ));
    assert_eq!(seeded_nodes(&plan), ["b"]);
    assert!(plan.seeds()[0].1.broadcast.is_none(), "{:?}", plan.seeds());
    assert_eq!(
        states(&plan),
        [
            ("a".into(), NodeState::Seeding),
            ("b".into(), NodeState::Seeding)
        ]
    );
}
