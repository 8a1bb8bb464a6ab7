//! The namespace watch against a scripted API server: lists, watch events,
//! a `410 Gone` forcing a relist, an HTTP 500 that is retried.

use std::time::Duration;

use http::StatusCode;
use kt_kube::mock::{self, MockApi, Reply};
use kt_kube::state::{Action, RecordedAgent};
use kt_kube::watch::{self, WatchConfig};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

fn config() -> WatchConfig {
    let mut cfg = WatchConfig::new("kt");
    cfg.backoff_initial = Duration::from_millis(5);
    cfg.backoff_max = Duration::from_millis(20);
    cfg
}

fn ok(body: serde_json::Value) -> Reply {
    Reply::Json(StatusCode::OK, body)
}

/// Receives actions until `want` were all seen (in any order); fails after 10 s.
async fn expect(rx: &mut mpsc::UnboundedReceiver<Action>, want: &[Action]) -> Vec<Action> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !want.iter().all(|w| got.contains(w)) {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(a)) => got.push(a),
            Ok(None) => panic!("the watch ended; got {got:?}, want {want:?}"),
            Err(_) => panic!("timed out; got {got:?}, want {want:?}"),
        }
    }
    got
}

/// Waits (10 s at most) until every watched kind's watch was requested:
/// a watcher asks for it only once the run loop handled its listing.
async fn watching_all(api: &MockApi) {
    const WATCHES: [&str; 7] = [
        "pods?watch",
        "deployments?watch",
        "statefulsets?watch",
        "daemonsets?watch",
        "replicasets?watch",
        "jobs?watch",
        "cronjobs?watch",
    ];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !WATCHES.iter().all(|w| api.count(w) > 0) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every kind is watched: {:?}",
            api.seen()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn evict(ids: &[&str]) -> Action {
    Action::Evict(ids.iter().map(|s| s.to_string()).collect())
}

#[tokio::test]
async fn deletes_relists_and_errors() {
    let api = MockApi::default();
    api.script("pods", mock::status(500, "etcd is having a moment"));
    api.script(
        "pods",
        ok(mock::list(
            &[
                mock::pod("web-a", "web", "Running", "10"),
                mock::pod("bare", "solo", "Running", "11"),
            ],
            "12",
        )),
    );
    api.script(
        "deployments",
        ok(mock::list(
            &[mock::workload("Deployment", "web", "web", "3")],
            "12",
        )),
    );
    // The pod watch: web-a is deleted, then the resource version expires.
    api.script(
        "pods?watch",
        Reply::Events(vec![
            mock::event("DELETED", mock::pod("web-a", "web", "Running", "13")),
            mock::gone(),
        ]),
    );
    // The relist: the bare pod went while the watch was away.
    api.script("pods", ok(mock::list(&[], "20")));
    let (client, task) = api.client("kt");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let shutdown = CancellationToken::new();
    let watching = tokio::spawn(watch::run(client, config(), vec![], tx, shutdown.clone()));

    let got = expect(
        &mut rx,
        &[
            evict(&["web-a"]),
            evict(&["bare"]),
            Action::Teardown("solo".into()),
        ],
    )
    .await;
    assert_eq!(got[0], evict(&["web-a"]), "the delete comes first: {got:?}");
    assert!(
        !got.contains(&Action::Teardown("web".into())),
        "the Deployment keeps web: {got:?}"
    );
    assert_eq!(
        api.count("pods"),
        3,
        "a failed list, the list, the relist: {:?}",
        api.seen()
    );
    let first = api
        .seen()
        .into_iter()
        .find(|s| s.contains(" pods "))
        .unwrap_or_default();
    assert!(first.contains("labelSelector=kt.dev%2Fservice"), "{first}");

    // The Deployment goes: so does its service.
    api.script(
        "deployments?watch",
        Reply::Events(vec![mock::event(
            "DELETED",
            mock::workload("Deployment", "web", "web", "21"),
        )]),
    );
    expect(&mut rx, &[Action::Teardown("web".into())]).await;

    shutdown.cancel();
    watching.await.expect("the watch ends on shutdown");
    task.abort();
}

#[tokio::test]
async fn startup_evicts_agents_that_vanished_while_away_but_deletes_no_data() {
    let api = MockApi::default();
    api.script(
        "pods",
        ok(mock::list(
            &[mock::pod("web-a", "web", "Running", "1")],
            "2",
        )),
    );
    api.script(
        "replicasets",
        ok(mock::list(
            &[mock::workload("ReplicaSet", "web-1", "web", "1")],
            "2",
        )),
    );
    let (client, task) = api.client("kt");
    let recorded = vec![
        RecordedAgent {
            id: "web-a".into(),
            service: Some("web".into()),
        },
        RecordedAgent {
            id: "old-0".into(),
            service: Some("old".into()),
        },
    ];
    let (tx, mut rx) = mpsc::unbounded_channel();
    let shutdown = CancellationToken::new();
    let watching = tokio::spawn(watch::run(client, config(), recorded, tx, shutdown.clone()));
    let got = expect(&mut rx, &[evict(&["old-0"])]).await;
    assert_eq!(got.len(), 1, "nothing else: {got:?}");
    // Nothing more happens while the watches stay quiet: the service `old`,
    // never seen live by this watch, keeps its keys.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), rx.recv())
            .await
            .is_err(),
        "no further action"
    );
    shutdown.cancel();
    watching.await.expect("the watch ends on shutdown");
    task.abort();
}

/// A CronJob keeps its service between runs: the run's pod finishing (its
/// Job unlabelled, as a CronJob's `jobTemplate` often leaves it) evicts the
/// agent and tears nothing down; deleting the CronJob does.
#[tokio::test]
async fn a_cronjob_keeps_its_service_after_a_run() {
    let api = MockApi::default();
    api.script(
        "pods",
        ok(mock::list(
            &[mock::pod("nightly-29-x", "nightly", "Running", "1")],
            "2",
        )),
    );
    api.script(
        "cronjobs",
        ok(mock::list(
            &[mock::workload("CronJob", "nightly", "nightly", "1")],
            "2",
        )),
    );
    let (client, task) = api.client("kt");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let shutdown = CancellationToken::new();
    let watching = tokio::spawn(watch::run(client, config(), vec![], tx, shutdown.clone()));
    // Every kind listed (each watch starts once its listing was handled):
    // from now on a service that goes is torn down.
    watching_all(&api).await;
    api.script(
        "pods?watch",
        Reply::Events(vec![mock::event(
            "MODIFIED",
            mock::pod("nightly-29-x", "nightly", "Succeeded", "3"),
        )]),
    );
    let got = expect(&mut rx, &[evict(&["nightly-29-x"])]).await;
    assert_eq!(got.len(), 1, "{got:?}");
    // A teardown would have been sent with the eviction, in the same step.
    assert!(
        rx.try_recv().is_err(),
        "the CronJob keeps the service `nightly`"
    );
    let first = api
        .seen()
        .into_iter()
        .find(|s| s.contains(" cronjobs "))
        .unwrap_or_default();
    assert!(
        first.contains("/apis/batch/v1/") && first.contains("labelSelector=kt.dev%2Fservice"),
        "{first}"
    );

    api.script(
        "cronjobs?watch",
        Reply::Events(vec![mock::event(
            "DELETED",
            mock::workload("CronJob", "nightly", "nightly", "4"),
        )]),
    );
    expect(&mut rx, &[Action::Teardown("nightly".into())]).await;
    shutdown.cancel();
    watching.await.expect("the watch ends on shutdown");
    task.abort();
}
