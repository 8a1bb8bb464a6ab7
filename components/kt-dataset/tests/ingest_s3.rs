//! S3 ingest against a real S3-compatible server (moto's server mode, a
//! child process) and real metadata and store servers in process.
//!
//! Without moto these tests fail under `CI=true` and skip elsewhere,
//! printing why (`bash testbed/s3/moto.sh` installs it; `make test` does).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kt_client::{Client, Progress};
use kt_dataset::ingest::moto::Moto;
use kt_dataset::ingest::plan::Record;
use kt_dataset::ingest::{IngestError, IngestEvent, S3Config, S3Credentials, ingest};
use kt_tests::{Cluster, bytes, fingerprint};
use kt_types::Key;
use kt_types::api::PutOptions;

const BUCKET: &str = "datasets";

/// moto, or `None` (the test skips) when it is not installed and this is
/// not CI.
async fn moto(checking_credentials: bool) -> Option<Moto> {
    let started = if checking_credentials {
        Moto::start_checking_credentials().await
    } else {
        Moto::start().await
    };
    Moto::or_skip(started)
}

fn config(moto: &Moto, prefix: &str) -> S3Config {
    S3Config {
        bucket: BUCKET.to_owned(),
        prefix: prefix.to_owned(),
        endpoint: Some(moto.endpoint().to_owned()),
        region: None,
        credentials: Some(S3Credentials {
            access_key_id: "test".to_owned(),
            secret_access_key: "test".to_owned(),
            session_token: None,
        }),
        concurrency: 4,
        record_every: Duration::ZERO,
    }
}

/// The objects `data/obj-i` (some nested), with distinct contents.
fn objects(n: usize) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let name = if i % 3 == 0 {
                format!("sub/dir/obj-{i}")
            } else {
                format!("obj-{i}")
            };
            (name, bytes(i as u64 + 1, 1000 + i * 3571))
        })
        .collect()
}

async fn fill(moto: &Moto, prefix: &str, objects: &[(String, Vec<u8>)]) {
    moto.create_bucket(BUCKET).await.expect("bucket");
    for (name, body) in objects {
        moto.put_object(BUCKET, &format!("{prefix}/{name}"), body.clone())
            .await
            .expect("put object");
    }
}

/// Gets `key` into a fresh directory and checks it holds exactly `want`,
/// byte for byte.
async fn assert_key_holds(client: &Client, key: &Key, dir: &Path, want: &[(String, Vec<u8>)]) {
    let dest = dir.join(format!("get-{}", uuid_like()));
    client.get(key, &dest, Progress::none()).await.expect("get");
    let got = fingerprint(&dest);
    let mut files: Vec<&str> = got
        .entries
        .iter()
        .filter(|e| e.kind == kt_types::EntryKind::File)
        .map(|e| e.path.as_str())
        .collect();
    files.sort_unstable();
    let mut names: Vec<&str> = want.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    assert_eq!(files, names);
    for (name, body) in want {
        assert_eq!(
            &std::fs::read(dest.join(name)).expect("read"),
            body,
            "{name}"
        );
    }
}

fn uuid_like() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    N.fetch_add(1, Ordering::Relaxed).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ingests_then_moves_only_what_changed_and_drops_what_is_gone() {
    let Some(moto) = moto(false).await else {
        return;
    };
    let cluster = Cluster::start().await;
    let client = cluster.client();
    let mut want = objects(12);
    fill(&moto, "data", &want).await;
    // Outside the prefix: never ingested.
    moto.put_object(BUCKET, "other/x", b"no".to_vec())
        .await
        .expect("put");
    // A folder marker (an empty object named like a directory).
    moto.put_object(BUCKET, "data/sub/", Vec::new())
        .await
        .expect("put");
    let key = Key::parse("datasets/ns/ds").expect("key");
    let staging = cluster.dir.path().join("staging");
    let events = Arc::new(AtomicUsize::new(0));
    let counted = events.clone();
    let progress: kt_dataset::ingest::OnProgress = Arc::new(move |e: &IngestEvent| {
        if matches!(e, IngestEvent::Fetched { .. }) {
            counted.fetch_add(1, Ordering::Relaxed);
        }
    });
    let cfg = config(&moto, "data");

    let first = ingest(&client, &key, &cfg, &staging, Some(progress.clone()))
        .await
        .expect("first ingest");
    let total: u64 = want.iter().map(|(_, b)| b.len() as u64).sum();
    assert_eq!((first.objects, first.bytes), (12, total));
    assert_eq!(
        (first.changed, first.removed, first.fetched_bytes),
        (12, 0, total)
    );
    assert_eq!(first.markers, 1);
    assert_eq!(events.load(Ordering::Relaxed), 12);
    assert_eq!(first.status.objects, 12);
    assert!(first.status.last_listed.is_some());
    let stat = client.stat(&key).await.expect("stat");
    assert_eq!(stat.version, first.version);
    assert_eq!(stat.lifespan, kt_types::Lifespan::Cluster);
    assert_key_holds(&client, &key, cluster.dir.path(), &want).await;

    // One object changes: only it is fetched, and only its bytes reach
    // the store.
    want[4].1 = bytes(99, 5000);
    moto.put_object(BUCKET, &format!("data/{}", want[4].0), want[4].1.clone())
        .await
        .expect("put");
    let second = ingest(&client, &key, &cfg, &staging, Some(progress.clone()))
        .await
        .expect("second ingest");
    assert_eq!((second.changed, second.removed), (1, 0));
    assert_eq!(second.fetched_bytes, 5000);
    assert_eq!(second.put.stats.files_sent, 1);
    assert_eq!(second.put.stats.bytes_sent, 5000);
    assert_ne!(second.version, first.version);
    assert_key_holds(&client, &key, cluster.dir.path(), &want).await;

    // One object is deleted: it disappears from the key.
    let gone = want.remove(3);
    moto.delete_object(BUCKET, &format!("data/{}", gone.0))
        .await
        .expect("delete");
    let third = ingest(&client, &key, &cfg, &staging, Some(progress))
        .await
        .expect("third ingest");
    assert_eq!((third.changed, third.removed, third.objects), (0, 1, 11));
    assert_eq!(third.put.stats.bytes_sent, 0);
    assert_key_holds(&client, &key, cluster.dir.path(), &want).await;

    // Nothing changed: nothing is fetched, the version stays.
    let fourth = ingest(&client, &key, &cfg, &staging, None)
        .await
        .expect("fourth ingest");
    assert_eq!((fourth.changed, fourth.removed), (0, 0));
    assert!(fourth.put.unchanged);
    assert_eq!(fourth.version, third.version);
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_interrupted_ingest_resumes_without_refetching_what_completed() {
    let Some(moto) = moto(false).await else {
        return;
    };
    let cluster = Cluster::start().await;
    let client = cluster.client();
    let want = objects(30);
    fill(&moto, "data", &want).await;
    let key = Key::parse("datasets/ns/resumed").expect("key");
    let staging = cluster.dir.path().join("staging");
    let cfg = config(&moto, "data");

    // Cut after 5 objects completed (the future is dropped, as by a crash).
    let fetched = Arc::new(AtomicUsize::new(0));
    let cut = Arc::new(tokio::sync::Notify::new());
    let (f, c) = (fetched.clone(), cut.clone());
    let progress: kt_dataset::ingest::OnProgress = Arc::new(move |e: &IngestEvent| {
        if matches!(e, IngestEvent::Fetched { .. }) && f.fetch_add(1, Ordering::SeqCst) + 1 == 5 {
            c.notify_one();
        }
    });
    tokio::select! {
        biased;
        _ = cut.notified() => {}
        r = ingest(&client, &key, &cfg, &staging, Some(progress)) => {
            panic!("the ingest finished before it was cut: {r:?}")
        }
    }
    // What the record says is complete (at least the 5, written after each).
    let record: Record =
        serde_json::from_slice(&std::fs::read(staging.join("record.json")).expect("record"))
            .expect("record json");
    let done = record.objects.len();
    assert!((5..30).contains(&done), "{done} recorded");
    // A crash's leftovers: a stray file in the tree and a part.
    std::fs::write(staging.join("tree/stray"), b"x").expect("stray");
    std::fs::write(staging.join("parts/7.part"), b"half").expect("part");
    assert!(client.stat(&key).await.is_err(), "nothing published yet");

    let resumed = ingest(&client, &key, &cfg, &staging, None)
        .await
        .expect("resumed ingest");
    assert_eq!(resumed.changed as usize, 30 - done);
    assert_eq!(resumed.objects, 30);
    assert_eq!(
        std::fs::read_dir(staging.join("parts"))
            .expect("parts")
            .count(),
        0
    );
    assert_key_holds(&client, &key, cluster.dir.path(), &want).await;
    cluster.stop().await;
}

/// A plain put of the staged tree (the ingest's options) finds the version
/// the ingest published: the same manifest, so the same digest.
async fn assert_plain_put_agrees(client: &Client, key: &Key, staging: &Path) {
    let options = PutOptions {
        lifespan: Some(kt_types::Lifespan::Cluster),
        ..PutOptions::default()
    };
    let before = client.stat(key).await.expect("stat");
    let again = client
        .put(key, &staging.join("tree"), options, Progress::none())
        .await
        .expect("plain put");
    assert!(
        again.unchanged,
        "a plain put of the staged tree must find the ingest's version: {again:?}"
    );
    assert_eq!(
        client.stat(key).await.expect("stat").version,
        before.version
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ingest_publishes_what_a_plain_put_of_its_staged_tree_does() {
    let Some(moto) = moto(false).await else {
        return;
    };
    let cluster = Cluster::start().await;
    let client = cluster.client();
    let mut want = objects(10);
    // A large object too (moved in chunks: larger than the test store's chunk size).
    want.push((
        "sub/large".to_owned(),
        bytes(77, 5 * kt_tests::CHUNK as usize + 3),
    ));
    want.push(("empty".to_owned(), Vec::new()));
    fill(&moto, "data", &want).await;
    let key = Key::parse("datasets/ns/agrees").expect("key");
    let staging = cluster.dir.path().join("staging");
    let cfg = config(&moto, "data");
    let first = ingest(&client, &key, &cfg, &staging, None)
        .await
        .expect("first ingest");
    assert_eq!(first.changed, 12);
    assert_plain_put_agrees(&client, &key, &staging).await;
    assert_key_holds(&client, &key, cluster.dir.path(), &want).await;
    // Some objects change, some stay: the kept ones as staged, the new
    // ones as listed, the directories as the ingest sets them.
    for i in [0, 5, 10] {
        want[i].1 = bytes(200 + i as u64, 2500 + i);
        moto.put_object(BUCKET, &format!("data/{}", want[i].0), want[i].1.clone())
            .await
            .expect("put");
    }
    let second = ingest(&client, &key, &cfg, &staging, None)
        .await
        .expect("second ingest");
    assert_eq!(second.changed, 3);
    assert_ne!(second.version, first.version);
    assert_plain_put_agrees(&client, &key, &staging).await;
    assert_key_holds(&client, &key, cluster.dir.path(), &want).await;
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_download_failing_mid_ingest_publishes_nothing() {
    let Some(moto) = moto(false).await else {
        return;
    };
    let moto = Arc::new(moto);
    let cluster = Cluster::start().await;
    let client = cluster.client();
    let mut want = objects(12);
    fill(&moto, "data", &want).await;
    let key = Key::parse("datasets/ns/failing").expect("key");
    let staging = cluster.dir.path().join("staging");
    let mut cfg = config(&moto, "data");
    let first = ingest(&client, &key, &cfg, &staging, None)
        .await
        .expect("first ingest");
    // Six objects change. One at a time, in name order, they are fetched
    // (and sent to the store as they come); the last of them is deleted
    // once listed, so its download fails after five others are down.
    let changed = [1usize, 2, 4, 5, 7, 9];
    let mut next = want.clone();
    for &i in &changed {
        next[i].1 = bytes(100 + i as u64, 3000 + i);
        moto.put_object(BUCKET, &format!("data/{}", next[i].0), next[i].1.clone())
            .await
            .expect("put");
    }
    assert_eq!(want[9].0, "sub/dir/obj-9", "the last changed name");
    let doomed = format!("data/{}", want[9].0);
    cfg.concurrency = 1;
    let fetched = Arc::new(AtomicUsize::new(0));
    let (m, f, d) = (moto.clone(), fetched.clone(), doomed.clone());
    let progress: kt_dataset::ingest::OnProgress = Arc::new(move |e: &IngestEvent| match e {
        IngestEvent::Planned { .. } => {
            let (m, d) = (m.clone(), d.clone());
            // The callback is synchronous: the delete runs to its end on a
            // thread of its own before the downloads start.
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime")
                    .block_on(m.delete_object(BUCKET, &d))
            })
            .join()
            .expect("delete thread")
            .expect("delete");
        }
        IngestEvent::Fetched { .. } => {
            f.fetch_add(1, Ordering::SeqCst);
        }
        _ => {}
    });
    let err = ingest(&client, &key, &cfg, &staging, Some(progress))
        .await
        .expect_err("a failed download must fail the ingest");
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(matches!(err, IngestError::Object { .. }), "{err:?}");
    assert!(msg.contains("sub/dir/obj-9"), "{msg}");
    assert_eq!(fetched.load(Ordering::SeqCst), 5);
    // Nothing published: the key keeps the first ingest's version and content.
    assert_eq!(
        client.stat(&key).await.expect("stat").version,
        first.version
    );
    assert_key_holds(&client, &key, cluster.dir.path(), &want).await;

    // The object back: a retry fetches only it (the five are recorded).
    moto.put_object(BUCKET, &doomed, next[9].1.clone())
        .await
        .expect("put");
    cfg.concurrency = 4;
    let retry = ingest(&client, &key, &cfg, &staging, None)
        .await
        .expect("retry");
    assert_eq!(retry.changed, 1);
    want = next;
    assert_key_holds(&client, &key, cluster.dir.path(), &want).await;
    cluster.stop().await;
}

/// An object replaced by a larger one between the listing and its GET is
/// refused on the GET's size, before its body reaches the staging volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_grown_since_the_listing_is_refused_unread() {
    let Some(moto) = moto(false).await else {
        return;
    };
    let moto = Arc::new(moto);
    let cluster = Cluster::start().await;
    let client = cluster.client();
    let want = objects(2);
    fill(&moto, "data", &want).await;
    let key = Key::parse("datasets/ns/grown").expect("key");
    let staging = cluster.dir.path().join("staging");
    let grown = format!("data/{}", want[0].0);
    let m = moto.clone();
    let progress: kt_dataset::ingest::OnProgress = Arc::new(move |e: &IngestEvent| {
        if let IngestEvent::Planned { .. } = e {
            let (m, g) = (m.clone(), grown.clone());
            // Synchronous callback: the put is done before the downloads.
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime")
                    .block_on(m.put_object(BUCKET, &g, vec![1; 1 << 20]))
            })
            .join()
            .expect("put thread")
            .expect("put");
        }
    });
    let err = ingest(
        &client,
        &key,
        &config(&moto, "data"),
        &staging,
        Some(progress),
    )
    .await
    .expect_err("a grown object must fail the ingest");
    let msg = err.to_string();
    assert!(matches!(err, IngestError::Object { .. }), "{err:?}");
    assert!(msg.contains(&want[0].0), "{msg}");
    assert!(msg.contains("changed since the listing"), "{msg}");
    assert!(client.stat(&key).await.is_err(), "nothing published");
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsafe_object_name_fails_naming_the_object() {
    let Some(moto) = moto(false).await else {
        return;
    };
    let cluster = Cluster::start().await;
    let client = cluster.client();
    fill(&moto, "data", &objects(2)).await;
    moto.put_object(BUCKET, "data/a/../../escape", b"x".to_vec())
        .await
        .expect("put");
    let key = Key::parse("datasets/ns/bad").expect("key");
    let staging = cluster.dir.path().join("staging");
    let err = ingest(&client, &key, &config(&moto, "data"), &staging, None)
        .await
        .expect_err("an unsafe name must fail the ingest");
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(msg.contains("a/../../escape"), "{msg}");
    assert!(
        matches!(err, IngestError::BadName { .. } | IngestError::Plan(_)),
        "{err:?}"
    );
    assert!(!cluster.dir.path().join("escape").exists());
    assert!(client.stat(&key).await.is_err());
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_fails_clearly() {
    let Some(moto) = moto(false).await else {
        return;
    };
    let cluster = Cluster::start().await;
    let client = cluster.client();
    let key = Key::parse("datasets/ns/missing").expect("key");
    let mut cfg = config(&moto, "data");
    cfg.bucket = "no-such-bucket".to_owned();
    let err = ingest(&client, &key, &cfg, &cluster.dir.path().join("s"), None)
        .await
        .expect_err("a missing bucket must fail");
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(matches!(err, IngestError::List { .. }), "{err:?}");
    assert!(msg.contains("s3://no-such-bucket/data"), "{msg}");
    assert!(msg.contains("NoSuchBucket"), "{msg}");
    assert!(!msg.contains('\n'), "one line: {msg}");
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_credential_fails_clearly() {
    let Some(moto) = moto(true).await else { return };
    let cluster = Cluster::start().await;
    let client = cluster.client();
    let key = Key::parse("datasets/ns/denied").expect("key");
    let err = ingest(
        &client,
        &key,
        &config(&moto, "data"),
        &cluster.dir.path().join("s"),
        None,
    )
    .await
    .expect_err("an unknown access key must fail");
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(matches!(err, IngestError::List { .. }), "{err:?}");
    assert!(
        msg.contains("InvalidAccessKeyId") || msg.contains("403"),
        "{msg}"
    );
    cluster.stop().await;
}
