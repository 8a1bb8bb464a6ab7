//! Puts of a tree whose files are still being written
//! (`Client::put_arriving`, what an S3 ingest does while it downloads):
//! files move as they arrive, the version published is the one a plain put
//! of the finished tree makes, and a file that arrives other than announced,
//! or arrivals that stop early, publish nothing.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kt_client::progress::ProgressSink;
use kt_client::{Arrived, Arriving, Client, ClientError, Progress};
use kt_tests::{CHUNK, Cluster, bytes, fingerprint, wait_until, write_files};
use kt_types::api::PutOptions;
use kt_types::{ErrorCode, Hash, Key, Manifest};
use tokio::sync::mpsc;

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

/// Small files (sent in batches), a large one (in chunks: CHUNK is the
/// test store's chunk size), an empty one, nested directories.
fn finished_tree(root: &Path, seed: u64) {
    write_files(
        root,
        &[
            ("a/one.bin", &bytes(seed, 5000)),
            ("a/b/two.bin", &bytes(seed + 1, 70_000)),
            ("big.bin", &bytes(seed + 2, 5 * CHUNK as usize + 17)),
            ("empty", b""),
            ("z.txt", b"last"),
        ],
    );
}

/// Bytes the put read to send, so far.
#[derive(Default)]
struct Sent(AtomicU64);

impl ProgressSink for Sent {
    fn start(&self, _: u64, _: u64) {}
    fn advance(&self, bytes: u64) {
        self.0.fetch_add(bytes, Ordering::SeqCst);
    }
    fn finish(&self) {}
}

/// Copies `rel` from `from` into `to` with its mode and mtime (what an
/// ingest's download makes of it), and says what arrived.
fn arrive(from: &Path, to: &Path, m: &Manifest, rel: &str) -> Arrived {
    let (src, dst) = (from.join(rel), to.join(rel));
    std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
    std::fs::copy(&src, &dst).unwrap();
    let md = std::fs::metadata(&src).unwrap();
    let f = std::fs::File::options().write(true).open(&dst).unwrap();
    f.set_permissions(md.permissions()).unwrap();
    f.set_times(std::fs::FileTimes::new().set_modified(md.modified().unwrap()))
        .unwrap();
    let index = m.entries.iter().position(|e| e.path == rel).unwrap() as u32;
    Arrived {
        index,
        hash: m.entries[index as usize].hash.unwrap(),
    }
}

/// Gives the directories of `to` the modes and mtimes of `from`'s.
fn same_dirs(from: &Path, to: &Path, m: &Manifest) {
    for e in m
        .entries
        .iter()
        .filter(|e| e.kind == kt_types::EntryKind::Dir)
    {
        let md = std::fs::metadata(from.join(&e.path)).unwrap();
        let d = std::fs::File::open(to.join(&e.path)).unwrap();
        d.set_permissions(md.permissions()).unwrap();
        d.set_times(std::fs::FileTimes::new().set_modified(md.modified().unwrap()))
            .unwrap();
    }
}

/// The put of `finished`'s tree into `src`, where `pending` files are not
/// yet: their hashes held back (deferred), they arrive on the returned sender.
fn arriving(
    finished: &Path,
    src: &Path,
    pending: &[&str],
) -> (Manifest, Arriving, mpsc::Sender<Arrived>) {
    let m = fingerprint(finished);
    let mut announced = m.clone();
    let mut idx = Vec::new();
    for rel in pending {
        let i = m.entries.iter().position(|e| e.path == *rel).unwrap();
        announced.entries[i].hash = None;
        idx.push(i as u32);
    }
    // What is not pending is in place already.
    for e in m
        .entries
        .iter()
        .filter(|e| e.kind == kt_types::EntryKind::File)
    {
        if !pending.contains(&e.path.as_str()) {
            arrive(finished, src, &m, &e.path);
        }
    }
    std::fs::create_dir_all(src).unwrap();
    let (tx, rx) = mpsc::channel(16);
    let tree = Arriving {
        manifest: announced,
        pending: idx,
        arrivals: rx,
    };
    (m, tree, tx)
}

async fn put_arriving(
    client: &Client,
    k: &str,
    src: &Path,
    tree: Arriving,
    progress: Progress,
) -> Result<kt_client::PutSummary, ClientError> {
    client
        .put_arriving(&key(k), src, tree, PutOptions::default(), progress)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_move_as_they_arrive_and_the_version_is_a_plain_put_s() {
    let c = Cluster::start().await;
    let client = c.client();
    let finished = c.dir.path().join("finished");
    finished_tree(&finished, 1);
    let src = c.dir.path().join("src");
    let pending = ["a/b/two.bin", "a/one.bin", "big.bin", "empty", "z.txt"];
    let (m, tree, tx) = arriving(&finished, &src, &pending);
    let sent = Arc::new(Sent::default());
    let progress = Progress::new(sent.clone());
    let put = {
        let (client, src) = (client.clone(), src.clone());
        tokio::spawn(
            async move { put_arriving(&client, "team/arriving", &src, tree, progress).await },
        )
    };
    // All but the last arrive: they are sent before it does.
    let mut before = 0;
    for rel in &pending[..4] {
        tx.send(arrive(&finished, &src, &m, rel)).await.unwrap();
        before += std::fs::metadata(finished.join(rel)).unwrap().len();
    }
    wait_until("the arrived files sent", Duration::from_secs(60), || {
        let sent = sent.clone();
        async move { sent.0.load(Ordering::SeqCst) >= before }
    })
    .await;
    assert!(!put.is_finished(), "the put waits for the last file");
    tx.send(arrive(&finished, &src, &m, "z.txt")).await.unwrap();
    same_dirs(&finished, &src, &m);
    let summary = put.await.unwrap().expect("the arriving put");
    assert!(!summary.unchanged);
    let digest = kt_sync::manifest_digest(&m);
    assert_eq!(summary.record.expect("record").digest, Some(digest));
    // A plain put of the finished tree: the same version, nothing moves.
    let again = client
        .put(
            &key("team/arriving"),
            &src,
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .unwrap();
    assert!(again.unchanged, "{again:?}");
    let dest = c.dir.path().join("dest");
    client
        .get(&key("team/arriving"), &dest, Progress::none())
        .await
        .unwrap();
    assert_eq!(fingerprint(&dest), m);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_other_than_announced_publishes_nothing() {
    let c = Cluster::start().await;
    let client = c.client();
    let old = c.dir.path().join("old");
    finished_tree(&old, 1);
    let first = client
        .put(
            &key("team/arriving-bad"),
            &old,
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .unwrap();
    let finished = c.dir.path().join("finished");
    finished_tree(&finished, 2);
    for (i, rel) in ["a/one.bin", "big.bin"].into_iter().enumerate() {
        let src = c.dir.path().join(format!("src-{i}"));
        let (m, tree, tx) = arriving(&finished, &src, &["a/one.bin", "big.bin"]);
        let put = {
            let (client, src) = (client.clone(), src.clone());
            tokio::spawn(async move {
                put_arriving(&client, "team/arriving-bad", &src, tree, Progress::none()).await
            })
        };
        for r in ["a/one.bin", "big.bin"] {
            let mut a = arrive(&finished, &src, &m, r);
            if r == rel {
                // Announced with a hash that is not its content's.
                a.hash = Hash(*blake3::hash(b"something else").as_bytes());
            }
            tx.send(a).await.unwrap();
        }
        let err = put
            .await
            .unwrap()
            .expect_err("a wrong hash must fail the put");
        assert_eq!(err.code(), Some(ErrorCode::HashMismatch), "{rel}: {err}");
        let stat = client.stat(&key("team/arriving-bad")).await.unwrap();
        assert_eq!(
            stat.version,
            first.record.as_ref().unwrap().version,
            "{rel}"
        );
    }
    let dest = c.dir.path().join("dest");
    client
        .get(&key("team/arriving-bad"), &dest, Progress::none())
        .await
        .unwrap();
    assert_eq!(fingerprint(&dest), fingerprint(&old));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrivals_that_stop_early_publish_nothing() {
    let c = Cluster::start().await;
    let client = c.client();
    let finished = c.dir.path().join("finished");
    finished_tree(&finished, 3);
    let src = c.dir.path().join("src");
    let (m, tree, tx) = arriving(&finished, &src, &["a/one.bin", "z.txt"]);
    let put = {
        let (client, src) = (client.clone(), src.clone());
        tokio::spawn(async move {
            put_arriving(&client, "team/arriving-cut", &src, tree, Progress::none()).await
        })
    };
    tx.send(arrive(&finished, &src, &m, "a/one.bin"))
        .await
        .unwrap();
    // The source fails: z.txt never arrives.
    drop(tx);
    let err = put
        .await
        .unwrap()
        .expect_err("an early end must fail the put");
    let msg = err.to_string();
    assert!(
        msg.contains("still to arrive") && msg.contains("z.txt"),
        "{msg}"
    );
    let e = client.stat(&key("team/arriving-cut")).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
    c.stop().await;
}
