//! A large file put again by a client that has no scan cache entry for it
//! (a fresh process, another machine putting the same tree) whose size is
//! that of the current version's file: the store asks the client to hash
//! it first (chunk by chunk), so a file only touched (another mtime, the
//! same bytes) moves nothing, and one changed in place moves only its
//! changed chunks (the store copies the others from its own file). A
//! change that kept the size and the mtime (`touch -r`) is still found.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use kt_client::{Client, Progress, PutSummary};
use kt_tests::{CHUNK, Cluster, bytes, fingerprint, write_files};
use kt_types::Key;
use kt_types::api::PutOptions;

/// 64 MiB: 1024 of the test store's chunks.
const SIZE: usize = 64 << 20;

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

async fn put(client: &Client, k: &Key, src: &Path) -> PutSummary {
    client
        .put(k, src, PutOptions::default(), Progress::none())
        .await
        .unwrap()
}

fn mtime(path: &Path) -> SystemTime {
    std::fs::metadata(path).unwrap().modified().unwrap()
}

fn set_mtime(path: &Path, t: SystemTime) {
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.set_modified(t).unwrap();
}

/// The tree: the large file and a small one; put once by a client whose
/// scan cache is then never used again.
async fn first_put(c: &Cluster, k: &Key) -> std::path::PathBuf {
    let src = c.dir.path().join("src");
    write_files(
        &src,
        &[("model.bin", &bytes(7, SIZE)), ("conf.json", b"{}")],
    );
    let first = put(&c.client(), k, &src).await;
    assert!(!first.unchanged);
    src
}

/// Gets `k` and checks it is `src` as it is now: contents, sizes, modes
/// and mtimes.
async fn reads_back(c: &Cluster, k: &Key, src: &Path, dest: &str) {
    let dest = c.dir.path().join(dest);
    c.client().get(k, &dest, Progress::none()).await.unwrap();
    assert_eq!(fingerprint(&dest), fingerprint(src));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_touched_large_file_put_by_a_fresh_client_moves_almost_nothing() {
    let c = Cluster::start().await;
    let k = key("touched/model");
    let src = first_put(&c, &k).await;
    let big = src.join("model.bin");
    set_mtime(&big, mtime(&big) + Duration::from_secs(3600));

    let before = c.store_metrics.bytes_in();
    let again = put(&c.client(), &k, &src).await;
    let received = c.store_metrics.bytes_in() - before;
    // A new version (the mtime is part of the tree), its content linked.
    assert!(!again.unchanged);
    assert_eq!(again.stats.bytes_sent, 0, "{:?}", again.stats);
    assert!(
        received < CHUNK,
        "the store received {received} bytes of a touched {SIZE}-byte file"
    );
    reads_back(&c, &k, &src, "dest").await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_size_change_with_its_mtime_kept_is_sent_and_only_its_chunks_move() {
    let c = Cluster::start().await;
    let k = key("touched/inplace");
    let src = first_put(&c, &k).await;
    let big = src.join("model.bin");

    // Bytes changed in place in two chunks, the mtime set back (`touch -r`):
    // size and mtime are those the store has.
    let was = mtime(&big);
    let f = std::fs::File::options().write(true).open(&big).unwrap();
    f.write_all_at(b"changed", 5 * CHUNK + 100).unwrap();
    f.write_all_at(b"also changed", SIZE as u64 - 20).unwrap();
    drop(f);
    set_mtime(&big, was);

    let before = c.store_metrics.bytes_in();
    let again = put(&c.client(), &k, &src).await;
    let received = c.store_metrics.bytes_in() - before;
    assert!(!again.unchanged, "a changed file was taken for unchanged");
    assert_eq!(again.stats.files_sent, 1, "{:?}", again.stats);
    assert_eq!(again.stats.bytes_sent, 2 * CHUNK, "{:?}", again.stats);
    assert!(
        received <= 2 * CHUNK,
        "the store received {received} bytes for two changed chunks"
    );
    assert_eq!(
        again.record.unwrap().digest,
        Some(kt_sync::manifest_digest(&fingerprint(&src)))
    );
    reads_back(&c, &k, &src, "dest").await;

    // Rewritten whole at the same size, a new mtime: sent whole, right.
    std::fs::write(&big, bytes(8, SIZE)).unwrap();
    set_mtime(&big, was + Duration::from_secs(60));
    let rewritten = put(&c.client(), &k, &src).await;
    assert!(!rewritten.unchanged);
    assert_eq!(rewritten.stats.bytes_sent, SIZE as u64);
    reads_back(&c, &k, &src, "dest2").await;
    c.stop().await;
}
