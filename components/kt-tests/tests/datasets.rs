//! Node-cache agents (`kt-agent --node-cache`) against real metadata and
//! store servers: seeding from the store, two nodes as one broadcast, a
//! second version replacing the first atomically, the budget, retain and
//! eviction, restart recovery, bad inputs.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kt_client::Progress;
use kt_tests::{CHUNK, Cluster, TOKEN, bytes, fingerprint, wait_until, write_files};
use kt_types::Key;
use kt_types::api::PutOptions;
use kt_types::dataset::{NodeDatasetState, NodeReport, SeedBroadcast, SeedRequest};

const WAIT: Duration = Duration::from_secs(60);

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

async fn node(c: &Cluster, id: &str, budget: Option<u64>) -> kt_tests::Agent {
    let root = c.dir.path().join(format!("datasets-{id}"));
    c.start_agent_with(id, |cfg| {
        let mut nc = kt_agent::datasets::NodeCacheConfig::new(format!("node-{id}"));
        nc.root = root;
        nc.budget = budget;
        cfg.node_cache = Some(nc);
    })
    .await
}

/// Puts `files` under `k`; returns the source tree, version and size.
async fn put(c: &Cluster, k: &str, files: &[(&str, Vec<u8>)]) -> (PathBuf, String, u64) {
    let src = c
        .dir
        .path()
        .join(format!("src-{}-{}", k.replace('/', "-"), files.len()));
    let _ = fs::remove_dir_all(&src);
    for (name, body) in files {
        write_files(&src, &[(name, body)]);
    }
    let s = c
        .client()
        .put(&key(k), &src, PutOptions::default(), Progress::none())
        .await
        .expect("put");
    let r = s.record.expect("record");
    (src, r.version, r.size)
}

fn http() -> reqwest::Client {
    kt_api::client()
}

async fn report(a: &kt_tests::Agent) -> NodeReport {
    http()
        .get(format!("{}/api/v1/datasets", a.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn seed(a: &kt_tests::Agent, ns: &str, name: &str, req: &SeedRequest) -> reqwest::Response {
    http()
        .put(format!("{}/api/v1/datasets/{ns}/{name}", a.url))
        .bearer_auth(TOKEN)
        .json(req)
        .send()
        .await
        .unwrap()
}

async fn delete(a: &kt_tests::Agent, ns: &str, name: &str, retain: bool) -> reqwest::Response {
    let q = if retain { "?retain=true" } else { "" };
    http()
        .delete(format!("{}/api/v1/datasets/{ns}/{name}{q}", a.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
}

async fn error_code(r: reqwest::Response) -> (u16, String) {
    let status = r.status().as_u16();
    let body: serde_json::Value = r.json().await.unwrap();
    (
        status,
        body["error"]["code"].as_str().unwrap_or("").to_owned(),
    )
}

async fn until_state(a: &kt_tests::Agent, ns: &str, name: &str, state: NodeDatasetState) {
    wait_until(
        &format!("{ns}/{name} {state:?} on {}", a.id),
        WAIT,
        || async {
            let r = report(a).await;
            if let Some(d) = r.dataset(ns, name) {
                assert_ne!(
                    (d.state, state),
                    (NodeDatasetState::Failed, NodeDatasetState::Ready),
                    "{d:?}"
                );
            }
            r.dataset(ns, name).is_some_and(|d| d.state == state)
        },
    )
    .await;
}

fn request(root: &str, ns: &str, name: &str, k: &str, version: &str, bytes: u64) -> SeedRequest {
    SeedRequest {
        key: k.into(),
        version: version.into(),
        path: kt_types::dataset::default_path(root, ns, name),
        bytes,
        broadcast: None,
    }
}

fn versions(root: &str, ns: &str, name: &str) -> usize {
    fs::read_dir(Path::new(root).join(".kt/versions").join(ns).join(name))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_seed_one_broadcast_then_a_new_version_replaces_the_old_atomically() {
    let c = Cluster::start().await;
    let big = bytes(7, (12 * CHUNK + 5) as usize);
    let (src, v1, size) = put(
        &c,
        "team/ds",
        &[
            ("a.txt", b"one-a".to_vec()),
            ("b.txt", b"one-b".to_vec()),
            ("big.bin", big.clone()),
        ],
    )
    .await;
    let mut n1 = node(&c, "n1", None).await;
    let n2 = node(&c, "n2", None).await;
    let (r1, r2) = (report(&n1).await, report(&n2).await);
    assert_eq!(r1.node, "node-n1");
    assert!(r1.datasets.is_empty() && r1.budget_bytes > 0 && r1.free_bytes > 0);

    // Both nodes join one group: the store sends one copy (a chain).
    let before = c.store_metrics.bytes_out();
    let mut reqs = Vec::new();
    for r in [&r1, &r2] {
        let mut q = request(&r.root, "team", "ds", "team/ds", &v1, size);
        q.broadcast = Some(SeedBroadcast {
            group: "seed-1".into(),
            fanout: 1,
            window_ms: 30_000,
        });
        reqs.push(q);
    }
    let (a, b) = tokio::join!(
        seed(&n1, "team", "ds", &reqs[0]),
        seed(&n2, "team", "ds", &reqs[1])
    );
    for resp in [a, b] {
        assert_eq!(resp.status().as_u16(), 202);
        let d: kt_types::dataset::NodeDataset = resp.json().await.unwrap();
        assert!(d.placed);
        assert_ne!(d.state, NodeDatasetState::Failed, "{d:?}");
    }
    until_state(&n1, "team", "ds", NodeDatasetState::Ready).await;
    until_state(&n2, "team", "ds", NodeDatasetState::Ready).await;
    let sent = c.store_metrics.bytes_out() - before;
    assert!(
        sent >= size && sent < 2 * size,
        "the store sent {sent} bytes for two nodes of a {size}-byte key"
    );
    let want = fingerprint(&src);
    for (a, r) in [(&n1, &r1), (&n2, &r2)] {
        let d = report(a).await.dataset("team", "ds").cloned().unwrap();
        assert_eq!(
            (d.version.as_str(), d.bytes, d.bytes_total),
            (v1.as_str(), size, size)
        );
        let path = PathBuf::from(&d.path);
        assert!(
            fs::symlink_metadata(&path)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        let real = path.canonicalize().unwrap();
        assert_eq!(fingerprint(&real), want);
        // Served to peers like a downloaded copy, from the version's directory.
        let x = a.exports.get(&key("team/ds")).expect("exported");
        assert_eq!((x.version.as_str(), &x.path), (v1.as_str(), &real));
        // The same request again is answered at once.
        let again = seed(
            a,
            "team",
            "ds",
            &request(&r.root, "team", "ds", "team/ds", &v1, size),
        )
        .await;
        let d: kt_types::dataset::NodeDataset = again.json().await.unwrap();
        assert_eq!(d.state, NodeDatasetState::Ready);
    }

    // A second version: a reader of the path sees one version or the
    // other, whole, never a mix; the old version's files go after.
    let (src2, v2, size2) = put(
        &c,
        "team/ds",
        &[
            ("a.txt", b"two-a".to_vec()),
            ("b.txt", b"two-b".to_vec()),
            ("big.bin", bytes(8, (12 * CHUNK) as usize)),
            ("c.txt", b"new".to_vec()),
        ],
    )
    .await;
    assert_ne!(v1, v2);
    let path = PathBuf::from(kt_types::dataset::default_path(&r1.root, "team", "ds"));
    let (stop, seen_two, reads) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let reader = {
        let (stop, seen_two, reads, path) =
            (stop.clone(), seen_two.clone(), reads.clone(), path.clone());
        kt_sync::task::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let Ok(dir) = path.canonicalize() else {
                    panic!("the dataset path stopped resolving");
                };
                let (Ok(a), Ok(b)) = (
                    fs::read_to_string(dir.join("a.txt")),
                    fs::read_to_string(dir.join("b.txt")),
                ) else {
                    // The old version removed after the switch, mid-read.
                    continue;
                };
                match (a.as_str(), b.as_str()) {
                    ("one-a", "one-b") => {}
                    ("two-a", "two-b") => {
                        assert!(dir.join("c.txt").exists(), "v2 without c.txt");
                        seen_two.store(true, Ordering::SeqCst);
                    }
                    other => panic!("a mix of versions: {other:?}"),
                }
                reads.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    let resp = seed(
        &n1,
        "team",
        "ds",
        &request(&r1.root, "team", "ds", "team/ds", &v2, size2),
    )
    .await;
    assert_eq!(resp.status().as_u16(), 202);
    wait_until("v2 ready on n1", WAIT, || async {
        report(&n1)
            .await
            .dataset("team", "ds")
            .is_some_and(|d| d.state == NodeDatasetState::Ready && d.version == v2)
    })
    .await;
    wait_until("the reader on v2", WAIT, || async {
        seen_two.load(Ordering::SeqCst)
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    reader.await.expect("the reader saw whole versions only");
    assert!(reads.load(Ordering::SeqCst) > 0);
    assert_eq!(
        fingerprint(&path.canonicalize().unwrap()),
        fingerprint(&src2)
    );
    assert_eq!(
        versions(&r1.root, "team", "ds"),
        1,
        "the old version is removed"
    );
    assert_eq!(n1.exports.get(&key("team/ds")).unwrap().version, v2);

    // A restarted agent reports and serves what it held.
    n1.restart().await;
    let after = report(&n1).await;
    let d = after.dataset("team", "ds").unwrap();
    assert_eq!(
        (d.state, d.version.as_str()),
        (NodeDatasetState::Ready, v2.as_str())
    );
    assert_eq!(after.used_bytes, size2);
    assert_eq!(
        fingerprint(&path.canonicalize().unwrap()),
        fingerprint(&src2)
    );
    assert_eq!(n1.exports.get(&key("team/ds")).unwrap().version, v2);

    // Removed: files, link and export go.
    assert_eq!(
        delete(&n1, "team", "ds", false).await.status().as_u16(),
        204
    );
    assert!(fs::symlink_metadata(&path).is_err());
    assert_eq!(versions(&r1.root, "team", "ds"), 0);
    assert!(n1.exports.get(&key("team/ds")).is_none());
    assert!(report(&n1).await.datasets.is_empty());
    // Again: nothing to do.
    assert_eq!(
        delete(&n1, "team", "ds", false).await.status().as_u16(),
        204
    );
    n1.stop().await;
    n2.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_budget_refuses_what_does_not_fit_and_evicts_retained_datasets() {
    let c = Cluster::start().await;
    let (_, va, size_a) = put(&c, "team/a", &[("f", bytes(1, (3 * CHUNK) as usize))]).await;
    let (src_b, vb, size_b) = put(&c, "team/b", &[("f", bytes(2, (3 * CHUNK) as usize))]).await;
    let budget = size_a + size_a / 2;
    let n = node(&c, "n", Some(budget)).await;
    let root = report(&n).await.root;
    assert_eq!(report(&n).await.budget_bytes, budget);

    let ra = request(&root, "team", "a", "team/a", &va, size_a);
    assert_eq!(seed(&n, "team", "a", &ra).await.status().as_u16(), 202);
    until_state(&n, "team", "a", NodeDatasetState::Ready).await;
    assert_eq!(report(&n).await.free_bytes, budget - size_a);

    // b does not fit beside a, which is placed.
    let rb = request(&root, "team", "b", "team/b", &vb, size_b);
    let (status, code) = error_code(seed(&n, "team", "b", &rb).await).await;
    assert_eq!((status, code.as_str()), (507, "insufficient_storage"));
    assert!(report(&n).await.dataset("team", "b").is_none());

    // a retained: unplaced, its files kept, its bytes free for a seed.
    let resp = delete(&n, "team", "a", true).await;
    assert_eq!(resp.status().as_u16(), 200);
    let d: kt_types::dataset::NodeDataset = resp.json().await.unwrap();
    assert!(!d.placed && d.state == NodeDatasetState::Ready);
    let path_a = PathBuf::from(&d.path);
    assert!(path_a.join("f").exists());
    let r = report(&n).await;
    assert_eq!((r.free_bytes, r.used_bytes), (budget, size_a));
    // Placed again with its version: ready at once, nothing fetched.
    let before = c.store_metrics.bytes_out();
    let again: kt_types::dataset::NodeDataset =
        seed(&n, "team", "a", &ra).await.json().await.unwrap();
    assert!(again.placed && again.state == NodeDatasetState::Ready);
    assert_eq!(c.store_metrics.bytes_out(), before);
    assert_eq!(delete(&n, "team", "a", true).await.status().as_u16(), 200);

    // b now fits by evicting a.
    assert_eq!(seed(&n, "team", "b", &rb).await.status().as_u16(), 202);
    until_state(&n, "team", "b", NodeDatasetState::Ready).await;
    let r = report(&n).await;
    assert!(r.dataset("team", "a").is_none(), "{r:?}");
    assert!(fs::symlink_metadata(&path_a).is_err());
    assert_eq!(versions(&root, "team", "a"), 0);
    assert_eq!(r.used_bytes, size_b);
    let b_path = PathBuf::from(&r.dataset("team", "b").unwrap().path);
    assert_eq!(
        fingerprint(&b_path.canonicalize().unwrap()),
        fingerprint(&src_b)
    );

    // A key that does not exist fails with a reason; a new PUT retries.
    let missing = request(&root, "team", "m", "team/missing", "v1", 1);
    assert_eq!(seed(&n, "team", "m", &missing).await.status().as_u16(), 202);
    until_state(&n, "team", "m", NodeDatasetState::Failed).await;
    let d = report(&n).await.dataset("team", "m").cloned().unwrap();
    assert!(d.error.is_some(), "{d:?}");
    assert_eq!(versions(&root, "team", "m"), 0);
    n.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors() {
    let c = Cluster::start().await;
    let n = node(&c, "n", None).await;
    let root = report(&n).await.root;
    let ok = request(&root, "team", "ds", "team/ds", "v1", 1);
    let cases: Vec<(&str, &str, SeedRequest, u16, &str)> = vec![
        ("Team", "ds", ok.clone(), 400, "invalid_request"),
        ("team", "d_s", ok.clone(), 400, "invalid_request"),
        (
            "team",
            "ds",
            SeedRequest {
                key: "../x".into(),
                ..ok.clone()
            },
            400,
            "invalid_key",
        ),
        (
            "team",
            "ds",
            SeedRequest {
                path: "/etc/ds".into(),
                ..ok.clone()
            },
            400,
            "invalid_request",
        ),
        (
            "team",
            "ds",
            SeedRequest {
                path: format!("{root}/.kt/versions/x"),
                ..ok.clone()
            },
            400,
            "invalid_request",
        ),
        (
            "team",
            "ds",
            SeedRequest {
                version: String::new(),
                ..ok.clone()
            },
            400,
            "invalid_request",
        ),
        (
            "team",
            "ds",
            SeedRequest {
                broadcast: Some(SeedBroadcast {
                    group: "g".into(),
                    fanout: 0,
                    window_ms: 1,
                }),
                ..ok.clone()
            },
            400,
            "invalid_request",
        ),
        (
            "team",
            "ds",
            SeedRequest {
                bytes: u64::MAX,
                ..ok.clone()
            },
            507,
            "insufficient_storage",
        ),
    ];
    for (ns, name, req, status, code) in cases {
        let got = error_code(seed(&n, ns, name, &req).await).await;
        assert_eq!(got, (status, code.to_owned()), "{ns}/{name} {req:?}");
    }
    // Not JSON; a bad query; no token or a wrong one.
    let r = http()
        .put(format!("{}/api/v1/datasets/team/ds", n.url))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body("{")
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(r).await, (400, "invalid_request".to_owned()));
    let r = http()
        .delete(format!("{}/api/v1/datasets/team/ds?retain=maybe", n.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(r).await, (400, "invalid_request".to_owned()));
    for token in [None, Some("wrong")] {
        let mut r = http().get(format!("{}/api/v1/datasets", n.url));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        assert_eq!(r.send().await.unwrap().status().as_u16(), 401);
    }
    // Two datasets may not share a path.
    let (_, v, size) = put(&c, "team/ds", &[("f", b"x".to_vec())]).await;
    let first = request(&root, "team", "ds", "team/ds", &v, size);
    assert_eq!(seed(&n, "team", "ds", &first).await.status().as_u16(), 202);
    let clash = SeedRequest {
        path: format!("{}/sub", first.path),
        ..first.clone()
    };
    let got = error_code(seed(&n, "team", "other", &clash).await).await;
    assert_eq!(got, (409, "conflict".to_owned()));
    until_state(&n, "team", "ds", NodeDatasetState::Ready).await;
    n.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_admin_callers_reach_the_dataset_api() {
    let c = Cluster::start().await;
    let agent_token = "agent-token";
    let root = c.dir.path().join("datasets-x");
    let n = c
        .start_agent_with("x", |cfg| {
            let mut nc = kt_agent::datasets::NodeCacheConfig::new("node-x");
            nc.root = root;
            cfg.node_cache = Some(nc);
            let agent = kt_types::auth::Principal {
                role: kt_types::auth::Role::Agent,
                name: Some("other".into()),
                ..kt_types::auth::Principal::admin()
            };
            cfg.server.auth = Some(
                kt_service::Auth::none()
                    .with_grant(
                        kt_service::Token::new(TOKEN).unwrap(),
                        kt_types::auth::Principal::admin(),
                    )
                    .with_grant(kt_service::Token::new(agent_token).unwrap(), agent),
            );
        })
        .await;
    let r = http()
        .get(format!("{}/api/v1/datasets", n.url))
        .bearer_auth(agent_token)
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(r).await, (403, "forbidden".to_owned()));
    assert!(report(&n).await.datasets.is_empty());
    n.stop().await;
    c.stop().await;
}

/// Two Datasets of one key on one node share the key's one export (the
/// later seed's). Removing either leaves the node serving the copy the
/// other still holds, never files that are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_datasets_of_one_key_keep_it_served_when_one_goes() {
    let c = Cluster::start().await;
    let (_src, v1, size) = put(&c, "team/shared", &[("a.txt", b"shared data".to_vec())]).await;
    let n1 = node(&c, "1", None).await;
    let r1 = report(&n1).await;
    for name in ["first", "second"] {
        let r = seed(
            &n1,
            "team",
            name,
            &request(&r1.root, "team", name, "team/shared", &v1, size),
        )
        .await;
        assert_eq!(r.status().as_u16(), 202);
        until_state(&n1, "team", name, NodeDatasetState::Ready).await;
    }
    let dir_of = |name: &str| {
        Path::new(&kt_types::dataset::default_path(&r1.root, "team", name))
            .canonicalize()
            .unwrap()
    };
    let (first, second) = (dir_of("first"), dir_of("second"));
    assert_ne!(first, second);
    let served = || n1.exports.get(&key("team/shared")).map(|x| x.path.clone());
    assert_eq!(served(), Some(second.clone()), "the later seed's copy");

    // The later one goes: the earlier one's copy is served again.
    assert_eq!(
        delete(&n1, "team", "second", false).await.status().as_u16(),
        204
    );
    assert!(!second.exists());
    assert_eq!(served(), Some(first.clone()));
    // Then the earlier one: nothing is served.
    assert_eq!(
        delete(&n1, "team", "first", false).await.status().as_u16(),
        204
    );
    assert_eq!(served(), None);
    n1.stop().await;
    c.stop().await;
}
