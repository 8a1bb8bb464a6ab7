//! The controller end to end, in process: the in-memory API server
//! (`kt_kube::apiserver`), a real metadata server and store, three
//! node-cache agents (`kt-agent` in node-cache mode, one per Node), and the
//! controller on kube-rs's runtime.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event as KubeEvent;
use kt_client::progress::Progress;
use kt_dataset::controller::{
    self, Config, Context, FINALIZER, Namespaces, NodeCachePods, PvcIngest,
};
use kt_dataset::crd::{Dataset, NodeState, Phase};
use kt_dataset::nodes::NodeCaches;
use kt_dataset::reconcile::Settings;
use kt_kube::apiserver::{ApiServer, ApiServerConfig};
use kt_tests::{Cluster, TOKEN, wait_until};
use kt_types::Key;
use kt_types::api::PutOptions;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const NS: &str = "team";
const CACHE_NS: &str = "kt-system";
const WAIT: Duration = Duration::from_secs(60);

struct Bed {
    cluster: Cluster,
    api: ApiServer,
    kube: kube::Client,
    agents: Vec<Option<kt_tests::Agent>>,
    roots: Vec<PathBuf>,
    stop: CancellationToken,
    _ctx: Arc<Context>,
}

fn node_name(i: usize) -> String {
    format!("node-{i}")
}

async fn start(nodes: usize) -> Bed {
    start_with(nodes, None).await
}

async fn start_with(nodes: usize, pvc: Option<PvcIngest>) -> Bed {
    let cluster = Cluster::start().await;
    let api = ApiServer::start(ApiServerConfig::default()).await.unwrap();
    api.register_crd(&kube::core::ApiResource::erase::<Dataset>(&()), true);
    let kube = api.client().unwrap();
    let mut agents = Vec::new();
    let mut roots = Vec::new();
    for i in 0..nodes {
        let name = node_name(i);
        let root = cluster.dir.path().join(format!("cache-{name}"));
        std::fs::create_dir_all(&root).unwrap();
        let agent = cluster
            .start_agent_with(&format!("cache-{name}"), |cfg| {
                let mut nc = kt_agent::datasets::NodeCacheConfig::new(&name);
                nc.root = root.clone();
                nc.budget = Some(1 << 30);
                cfg.node_cache = Some(nc);
            })
            .await;
        let port: u16 = agent.url.rsplit(':').next().unwrap().parse().unwrap();
        api.put(
            &serde_json::from_value::<Node>(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": { "name": name, "labels": { "kubernetes.io/hostname": name } },
                "status": { "conditions": [{ "type": "Ready", "status": "True" }] },
            }))
            .unwrap(),
        )
        .unwrap();
        api.put(&pod(&name, port)).unwrap();
        agents.push(Some(agent));
        roots.push(root);
    }
    let kt = cluster.client();
    let http = kt_api::client();
    let caches = NodeCaches::new(
        http,
        kt_api::Credential::fixed(TOKEN),
        "http",
        8090,
        Duration::from_secs(2),
    );
    let ctx = Context::new(
        kube.clone(),
        kt,
        caches,
        Config {
            namespace: CACHE_NS.into(),
            datasets: Namespaces::parse(&format!("{CACHE_NS},{NS}")).unwrap(),
            settings: Settings {
                seed_window: Duration::from_millis(500),
                busy_requeue: Duration::from_millis(200),
                ready_requeue: Duration::from_millis(500),
                failed_requeue: Duration::from_secs(60),
            },
            pvc,
            staging_dir: cluster.dir.path().join("staging"),
            // The agents share 127.0.0.1, each on a port of its own.
            node_cache_pods: NodeCachePods {
                port_from_pod: true,
                ..NodeCachePods::default()
            },
        },
    );
    let stop = CancellationToken::new();
    tokio::spawn(controller::run(ctx.clone(), stop.clone()));
    Bed {
        cluster,
        api,
        kube,
        agents,
        roots,
        stop,
        _ctx: ctx,
    }
}

fn pod(node: &str, port: u16) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("node-cache-{node}"),
            "namespace": CACHE_NS,
            "labels": { "app.kubernetes.io/component": "node-cache" },
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "DaemonSet", "name": "kt-node-cache",
                "uid": "u-node-cache", "controller": true,
            }],
        },
        "spec": {
            "nodeName": node,
            "serviceAccountName": "kt-node-cache",
            "containers": [{
                "name": "agent", "image": "kt-agent",
                "ports": [{ "name": "node-cache", "containerPort": port }],
            }],
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{ "type": "Ready", "status": "True" }],
        },
    }))
    .unwrap()
}

async fn put_key(bed: &Bed, key: &str, files: &[(&str, &[u8])]) -> String {
    let src = bed
        .cluster
        .dir
        .path()
        .join(format!("src-{}", key.replace('/', "-")));
    kt_tests::write_files(&src, files);
    let client = bed.cluster.client();
    let summary = client
        .put(
            &Key::parse(key).unwrap(),
            &src,
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .unwrap();
    summary.record.expect("the put's record").version
}

async fn create(bed: &Bed, name: &str, spec: serde_json::Value) {
    let api: Api<Dataset> = Api::namespaced(bed.kube.clone(), NS);
    let ds: Dataset = serde_json::from_value(json!({
        "apiVersion": "kt.dev/v1alpha1", "kind": "Dataset",
        "metadata": { "name": name, "namespace": NS },
        "spec": spec,
    }))
    .unwrap();
    api.create(&PostParams::default(), &ds).await.unwrap();
}

async fn dataset(bed: &Bed, name: &str) -> Option<Dataset> {
    Api::<Dataset>::namespaced(bed.kube.clone(), NS)
        .get_opt(name)
        .await
        .unwrap()
}

async fn labels(bed: &Bed) -> BTreeMap<String, String> {
    let nodes = Api::<Node>::all(bed.kube.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    nodes
        .items
        .iter()
        .filter_map(|n| {
            n.labels()
                .get("data.kt.dev/team.ds")
                .map(|v| (n.name_any(), v.clone()))
        })
        .collect()
}

/// The key's current version in the store; None: not there.
async fn stored_version(bed: &Bed, key: &str) -> Option<String> {
    match bed.cluster.client().stat(&Key::parse(key).unwrap()).await {
        Ok(r) => Some(r.version),
        Err(e) if e.code() == Some(kt_types::ErrorCode::NotFound) => None,
        Err(e) => panic!("stat {key}: {e}"),
    }
}

fn data_on(root: &Path) -> Option<Vec<u8>> {
    data_of(root, "ds")
}

fn data_of(root: &Path, name: &str) -> Option<Vec<u8>> {
    std::fs::read(root.join(NS).join(name).join("a.txt")).ok()
}

async fn phase_is(bed: &Bed, name: &str, phase: Phase) -> bool {
    dataset(bed, name)
        .await
        .and_then(|d| d.status)
        .is_some_and(|s| s.phase == phase)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dataset_from_a_key_is_placed_replaced_and_removed() {
    let mut bed = start(3).await;
    let version = put_key(
        &bed,
        "team/ds",
        &[("a.txt", b"hello nodes"), ("b/c.bin", &[7u8; 5000])],
    )
    .await;
    create(
        &bed,
        "ds",
        json!({ "source": { "key": "team/ds" }, "placement": { "replicas": 2 } }),
    )
    .await;

    wait_until("the dataset is Ready", WAIT, || {
        phase_is(&bed, "ds", Phase::Ready)
    })
    .await;
    wait_until("two nodes labelled", WAIT, || async {
        labels(&bed).await.len() == 2
    })
    .await;
    let ds = dataset(&bed, "ds").await.unwrap();
    assert!(ds.finalizers().iter().any(|f| f == FINALIZER));
    let status = ds.status.unwrap();
    assert_eq!(status.version.as_deref(), Some(version.as_str()));
    assert_eq!(status.ready_nodes, 2);
    assert_eq!(status.observed_generation, ds.metadata.generation);
    assert!(
        status.conditions.iter().all(|c| c.status == "True"),
        "{:?}",
        status.conditions
    );
    let labelled = labels(&bed).await;
    let label = kt_dataset::reconcile::label_value(&version);
    assert!(labelled.values().all(|v| *v == label), "{labelled:?}");
    for (i, root) in bed.roots.iter().enumerate() {
        let expect = labelled.contains_key(&node_name(i));
        assert_eq!(data_on(root).is_some(), expect, "node {i}");
        if expect {
            assert_eq!(data_on(root).unwrap(), b"hello nodes");
        }
    }

    // An agent stops: its node is Lost and the third node takes its place.
    let (lost, _) = labelled
        .iter()
        .next()
        .map(|(n, v)| (n.clone(), v.clone()))
        .unwrap();
    let lost_i: usize = lost.trim_start_matches("node-").parse().unwrap();
    let spare = (0..3)
        .find(|i| !labelled.contains_key(&node_name(*i)))
        .unwrap();
    bed.agents[lost_i].take().unwrap().stop().await;
    wait_until("the lost node is replaced", WAIT, || async {
        let Some(s) = dataset(&bed, "ds").await.and_then(|d| d.status) else {
            return false;
        };
        let lost_ok = s
            .nodes
            .iter()
            .any(|n| n.name == lost && n.state == NodeState::Lost);
        let spare_ok = s.nodes.iter().any(|n| {
            n.name == node_name(spare)
                && n.state == NodeState::Ready
                && n.message
                    .as_deref()
                    .is_some_and(|m| m.contains(&format!("replaces node {lost}")))
        });
        lost_ok && spare_ok && s.phase == Phase::Ready
    })
    .await;
    wait_until("labels moved", WAIT, || async {
        let l = labels(&bed).await;
        l.len() == 2 && !l.contains_key(&lost) && l.contains_key(&node_name(spare))
    })
    .await;
    assert_eq!(data_on(&bed.roots[spare]).unwrap(), b"hello nodes");

    // Delete: labels and data go, then the finalizer, then the Dataset.
    Api::<Dataset>::namespaced(bed.kube.clone(), NS)
        .delete("ds", &DeleteParams::default())
        .await
        .unwrap();
    wait_until("the dataset is gone", WAIT, || async {
        dataset(&bed, "ds").await.is_none()
    })
    .await;
    assert!(labels(&bed).await.is_empty());
    for (i, root) in bed.roots.iter().enumerate() {
        if i != lost_i {
            assert!(data_on(root).is_none(), "node {i} still holds the data");
        }
    }
    assert_eq!(
        stored_version(&bed, "team/ds").await.as_deref(),
        Some(version.as_str()),
        "a key source is the user's: it stays"
    );
    bed.stop.cancel();
    for a in bed.agents.iter_mut().filter_map(Option::take) {
        a.stop().await;
    }
    drop(bed.api);
    bed.cluster.stop().await;
}

/// A Dataset in a namespace the controller was not told to obey is not
/// touched (no finalizer, no status, no label, no seed), though its key is
/// there and another namespace's Dataset of the same key is placed; the
/// controller's metrics count what it did, with no names as labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn datasets_outside_the_controllers_namespaces_are_ignored() {
    let bed = start(2).await;
    put_key(&bed, "team/ds", &[("a.txt", b"only for team")]).await;
    let intruder: Api<Dataset> = Api::namespaced(bed.kube.clone(), "intruder");
    let ds: Dataset = serde_json::from_value(json!({
        "apiVersion": "kt.dev/v1alpha1", "kind": "Dataset",
        "metadata": { "name": "ds", "namespace": "intruder" },
        "spec": { "source": { "key": "team/ds" }, "placement": { "replicas": 2 } },
    }))
    .unwrap();
    intruder.create(&PostParams::default(), &ds).await.unwrap();
    create(
        &bed,
        "ds",
        json!({ "source": { "key": "team/ds" }, "placement": { "replicas": 2 } }),
    )
    .await;
    wait_until("team's dataset is Ready", WAIT, || {
        phase_is(&bed, "ds", Phase::Ready)
    })
    .await;
    let theirs = intruder.get("ds").await.unwrap();
    assert!(theirs.finalizers().is_empty(), "{:?}", theirs.metadata);
    assert!(theirs.status.is_none(), "{:?}", theirs.status);
    let nodes = Api::<Node>::all(bed.kube.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    for n in &nodes.items {
        assert!(
            !n.labels().contains_key("data.kt.dev/intruder.ds"),
            "{:?}",
            n.labels()
        );
    }
    for root in &bed.roots {
        assert!(!root.join("intruder").exists());
    }
    // Deleting it needs no controller (no finalizer holds it).
    intruder
        .delete("ds", &DeleteParams::default())
        .await
        .unwrap();
    assert!(intruder.get_opt("ds").await.unwrap().is_none());

    let mut registry = prometheus_client::registry::Registry::with_prefix("kt");
    bed._ctx.stats().register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for line in [
        "kt_dataset_datasets{phase=\"Ready\"} 1",
        "kt_dataset_seeds_total{mode=\"broadcast\"} ",
        "kt_dataset_node_caches{state=\"reachable\"} 2",
    ] {
        assert!(text.contains(line), "{line}\n{text}");
    }
    assert!(
        !text.contains("intruder") && !text.contains("node-0"),
        "{text}"
    );
    bed.stop.cancel();
    drop(bed.api);
    bed.cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bad_key_fails_with_a_reason_and_a_warning_event() {
    let bed = start(1).await;
    create(&bed, "nope", json!({ "source": { "key": "team/missing" } })).await;
    wait_until("the dataset is Failed", Duration::from_secs(20), || {
        phase_is(&bed, "nope", Phase::Failed)
    })
    .await;
    let status = dataset(&bed, "nope").await.unwrap().status.unwrap();
    assert_eq!(status.reason.as_deref(), Some("KeyNotFound"));
    let events: Api<KubeEvent> = Api::namespaced(bed.kube.clone(), NS);
    wait_until("a Warning event", Duration::from_secs(20), || async {
        events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .any(|e| {
                e.type_.as_deref() == Some("Warning")
                    && e.reason.as_deref() == Some("KeyNotFound")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("nope")
                    && e.note
                        .as_deref()
                        .is_some_and(|n| n.contains("team/missing"))
            })
    })
    .await;
    bed.stop.cancel();
}

/// A PVC source: the controller starts a Job running `kt put` with the
/// claim mounted read-only; once the Job completes (here the test does
/// what its pod would: the put, then the Job's status), the key is placed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pvc_source_is_put_by_a_job_then_placed() {
    let bed = start_with(
        1,
        Some(PvcIngest {
            image: "kt-client:test".into(),
            metadata_url: "http://kt-metadata:8081".into(),
            token_secret: "kt-token".into(),
            service_account: None,
        }),
    )
    .await;
    create(
        &bed,
        "ds-pvc",
        json!({ "source": { "pvc": { "claimName": "data", "path": "train" } } }),
    )
    .await;
    wait_until("the dataset is Ingesting", WAIT, || {
        phase_is(&bed, "ds-pvc", Phase::Ingesting)
    })
    .await;
    let uid = dataset(&bed, "ds-pvc").await.unwrap().uid().unwrap();
    let jobs: Api<Job> = Api::namespaced(bed.kube.clone(), NS);
    let name = format!("ktds-ingest-{uid}");
    let job = jobs.get(&name).await.unwrap();
    let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(
        pod.containers[0].args.as_deref().unwrap(),
        [
            "put",
            "datasets/team/ds-pvc",
            "--src",
            "/source/train",
            "--lifespan",
            "cluster"
        ]
    );
    let claim = pod
        .volumes
        .iter()
        .flatten()
        .find_map(|v| v.persistent_volume_claim.clone())
        .unwrap();
    assert_eq!(
        (claim.claim_name.as_str(), claim.read_only),
        ("data", Some(true))
    );

    // What the Job's pod does, then what the Job controller writes.
    let version = put_key(
        &bed,
        "datasets/team/ds-pvc",
        &[("a.txt", b"from the claim")],
    )
    .await;
    let mut done = job.clone();
    done.status = Some(
        serde_json::from_value(json!({
            "succeeded": 1,
            "conditions": [{ "type": "Complete", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z" }],
        }))
        .unwrap(),
    );
    bed.api.put(&done).unwrap();
    wait_until("the dataset is Ready", WAIT, || {
        phase_is(&bed, "ds-pvc", Phase::Ready)
    })
    .await;
    let status = dataset(&bed, "ds-pvc").await.unwrap().status.unwrap();
    assert_eq!(status.key.as_deref(), Some("datasets/team/ds-pvc"));
    assert_eq!(status.version.as_deref(), Some(version.as_str()));
    assert_eq!(data_of(&bed.roots[0], "ds-pvc").unwrap(), b"from the claim");
    bed.stop.cancel();
}

/// An S3 source (moto's server; the test skips without it, and fails
/// without it under `CI=true`): ingested into `datasets/<ns>/<name>` with
/// the credentials of its Secret, placed; a changed object makes a new
/// version on the next refresh, and the labels move to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_s3_source_is_ingested_placed_and_refreshed() {
    use kt_dataset::ingest::moto::Moto;
    let Some(moto) = Moto::or_skip(Moto::start().await) else {
        return;
    };
    moto.create_bucket("datasets").await.unwrap();
    moto.put_object("datasets", "train/a.txt", b"first".to_vec())
        .await
        .unwrap();
    moto.put_object("datasets", "train/sub/b.bin", vec![3u8; 10_000])
        .await
        .unwrap();
    let bed = start(2).await;
    bed.api
        .put(
            &serde_json::from_value::<k8s_openapi::api::core::v1::Secret>(json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": { "name": "s3", "namespace": NS },
                "stringData": {},
                "data": {
                    "AWS_ACCESS_KEY_ID": "dGVzdA==",
                    "AWS_SECRET_ACCESS_KEY": "dGVzdA==",
                },
            }))
            .unwrap(),
        )
        .unwrap();
    create(
        &bed,
        "ds-s3",
        json!({
            "source": { "s3": {
                "bucket": "datasets", "prefix": "train/",
                "endpoint": moto.endpoint(), "credentialsSecret": "s3",
            } },
            "placement": { "replicas": 2 },
            "refresh": { "interval": "1s" },
        }),
    )
    .await;
    wait_until("the dataset is Ready", WAIT, || {
        phase_is(&bed, "ds-s3", Phase::Ready)
    })
    .await;
    let first = dataset(&bed, "ds-s3").await.unwrap().status.unwrap();
    assert_eq!(first.key.as_deref(), Some("datasets/team/ds-s3"));
    assert_eq!(first.ingest.as_ref().unwrap().objects, 2);
    for root in &bed.roots {
        assert_eq!(data_of(root, "ds-s3").unwrap(), b"first");
        let b = std::fs::read(root.join(NS).join("ds-s3").join("sub/b.bin")).unwrap();
        assert_eq!(b, vec![3u8; 10_000]);
    }

    moto.put_object("datasets", "train/a.txt", b"second".to_vec())
        .await
        .unwrap();
    let v1 = first.version.clone().unwrap();
    wait_until("the new version is placed", WAIT, || async {
        let Some(s) = dataset(&bed, "ds-s3").await.and_then(|d| d.status) else {
            return false;
        };
        s.phase == Phase::Ready && s.version.as_deref().is_some_and(|v| v != v1)
    })
    .await;
    let second = dataset(&bed, "ds-s3").await.unwrap().status.unwrap();
    assert_eq!(
        second.ingest.as_ref().unwrap().changed,
        1,
        "only the changed object moved"
    );
    let label = kt_dataset::reconcile::label_value(second.version.as_deref().unwrap());
    wait_until("labels moved", WAIT, || async {
        let nodes = Api::<Node>::all(bed.kube.clone())
            .list(&ListParams::default())
            .await
            .unwrap();
        nodes
            .items
            .iter()
            .all(|n| n.labels().get("data.kt.dev/team.ds-s3") == Some(&label))
    })
    .await;
    for root in &bed.roots {
        assert_eq!(data_of(root, "ds-s3").unwrap(), b"second");
    }

    // Deleted (an ingest may be running: the interval is 1s): the staging
    // copy of the source goes too, not only the nodes' copies.
    let staging = bed
        .cluster
        .dir
        .path()
        .join("staging")
        .join(NS)
        .join("ds-s3");
    assert!(staging.exists());
    Api::<Dataset>::namespaced(bed.kube.clone(), NS)
        .delete("ds-s3", &DeleteParams::default())
        .await
        .unwrap();
    wait_until("the dataset is gone", WAIT, || async {
        dataset(&bed, "ds-s3").await.is_none()
    })
    .await;
    wait_until("its staging directory is gone", WAIT, || async {
        !staging.exists()
    })
    .await;
    assert_eq!(
        stored_version(&bed, "datasets/team/ds-s3").await,
        None,
        "reclaimPolicy Delete (the default): the ingested key goes with the Dataset"
    );
    bed.stop.cancel();
}

/// What a PVC ingest Job's pod does once the controller started it: the
/// put of the Dataset's key. Returns the Job.
async fn pod_puts(bed: &Bed, name: &str, data: &[u8]) -> (Job, String) {
    wait_until("the dataset is Ingesting", WAIT, || {
        phase_is(bed, name, Phase::Ingesting)
    })
    .await;
    let uid = dataset(bed, name).await.unwrap().uid().unwrap();
    let job = Api::<Job>::namespaced(bed.kube.clone(), NS)
        .get(&format!("ktds-ingest-{uid}"))
        .await
        .unwrap();
    let version = put_key(bed, &format!("datasets/{NS}/{name}"), &[("a.txt", data)]).await;
    (job, version)
}

/// Ingested keys' lifecycle (PVC sources, driven by hand as above): with
/// `reclaimPolicy: Delete` (the default), deleting the Dataset deletes its
/// running ingest Job first, waits until the Job is gone (here a finalizer
/// holds it, as its pods do under foreground deletion, while the pod's late
/// put lands), and only then deletes `datasets/<ns>/<name>`; with `Retain`
/// the key stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ingested_key_goes_with_its_dataset_unless_retained() {
    let bed = start_with(
        1,
        Some(PvcIngest {
            image: "kt-client:test".into(),
            metadata_url: "http://kt-metadata:8081".into(),
            token_secret: "kt-token".into(),
            service_account: Some("kt-dataset-ingest".into()),
        }),
    )
    .await;
    let datasets: Api<Dataset> = Api::namespaced(bed.kube.clone(), NS);
    let jobs: Api<Job> = Api::namespaced(bed.kube.clone(), NS);

    // Retain: ingested, placed, deleted; the key stays.
    create(
        &bed,
        "kept",
        json!({ "source": { "pvc": { "claimName": "data" } }, "reclaimPolicy": "Retain" }),
    )
    .await;
    let (job, kept) = pod_puts(&bed, "kept", b"kept").await;
    let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(
        pod.service_account_name.as_deref(),
        Some("kt-dataset-ingest")
    );
    let mut done = job.clone();
    done.status = Some(
        serde_json::from_value(json!({
            "succeeded": 1,
            "conditions": [{ "type": "Complete", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z" }],
        }))
        .unwrap(),
    );
    bed.api.put(&done).unwrap();
    wait_until("kept is Ready", WAIT, || {
        phase_is(&bed, "kept", Phase::Ready)
    })
    .await;
    datasets
        .delete("kept", &DeleteParams::default())
        .await
        .unwrap();
    wait_until("kept is gone", WAIT, || async {
        dataset(&bed, "kept").await.is_none()
    })
    .await;
    assert_eq!(
        stored_version(&bed, "datasets/team/kept").await.as_deref(),
        Some(kept.as_str()),
        "reclaimPolicy Retain keeps the ingested key"
    );

    // Delete, with the Job still running: it goes first, then the key.
    create(
        &bed,
        "gone",
        json!({ "source": { "pvc": { "claimName": "data" } } }),
    )
    .await;
    let (job, first) = pod_puts(&bed, "gone", b"first").await;
    let job_name = job.name_any();
    // Held as its pods would hold it under foreground deletion.
    let mut held = job.clone();
    held.metadata.finalizers = Some(vec!["test.kt.dev/pods".into()]);
    bed.api.put(&held).unwrap();
    datasets
        .delete("gone", &DeleteParams::default())
        .await
        .unwrap();
    wait_until("the running Job is being deleted", WAIT, || async {
        jobs.get_opt(&job_name)
            .await
            .unwrap()
            .is_some_and(|j| j.metadata.deletion_timestamp.is_some())
    })
    .await;
    // Its pod's put lands late (a new version), then the pod is gone.
    let late = put_key(&bed, "datasets/team/gone", &[("a.txt", b"late")]).await;
    assert_ne!(late, first);
    assert!(
        dataset(&bed, "gone").await.is_some(),
        "the finalizer waits for the Job"
    );
    let mut released = jobs.get(&job_name).await.unwrap();
    released.metadata.finalizers = None;
    bed.api.put(&released).unwrap();
    wait_until("gone is gone", WAIT, || async {
        dataset(&bed, "gone").await.is_none()
    })
    .await;
    assert!(jobs.get_opt(&job_name).await.unwrap().is_none());
    assert_eq!(
        stored_version(&bed, "datasets/team/gone").await,
        None,
        "the ingested key goes with its Dataset, the late put too"
    );
    assert_eq!(
        stored_version(&bed, "datasets/team/kept").await.as_deref(),
        Some(kept.as_str()),
        "another Dataset's key is not touched"
    );
    bed.stop.cancel();
}
