//! Puts that hash a large file while they send it (`PutRequest::deferred`):
//! the version published is the one a put that hashed first makes, a client
//! whose roots do not match what arrived publishes nothing, the store checks
//! what is deferred, an interrupted upload resumes, a file rewritten
//! during the put is never published torn, and the scan cache knows the
//! file afterwards.

use std::path::{Path, PathBuf};

use kt_client::{Client, Progress};
use kt_tests::{CHUNK, Cluster, TOKEN, bytes, fingerprint, write_files};
use kt_types::api::{CommitResponse, DEFERRED_HASH, PutOptions, PutPlan};
use kt_types::{ErrorBody, ErrorCode, Hash, Key, Manifest};

/// Larger than the client's threshold for deferring (4 MiB), and many chunks.
const BIG: usize = (5 << 20) + 77;

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

/// The digest a put that hashed everything first publishes.
fn hashed_digest(src: &Path) -> Hash {
    let m = kt_sync::scan(src, &mut kt_sync::ScanCache::default()).unwrap();
    kt_sync::manifest_digest(&m)
}

fn tree(root: &Path, seed: u64) {
    write_files(
        root,
        &[
            ("big.bin", &bytes(seed, BIG)),
            ("conf/a.json", b"{}"),
            ("mid.bin", &bytes(seed + 1, 3 * CHUNK as usize + 5)),
        ],
    );
}

async fn put(client: &Client, k: &str, src: &Path) -> kt_client::PutSummary {
    client
        .put(&key(k), src, PutOptions::default(), Progress::none())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_put_hashing_while_it_sends_publishes_what_a_hashed_put_would() {
    let c = Cluster::start().await;
    let src = c.dir.path().join("src");
    tree(&src, 1);
    let want = hashed_digest(&src);
    let cache = c.dir.path().join("cache-a");
    let client = c.client_with(|cfg| cfg.cache_dir = Some(cache.clone()));
    let first = put(&client, "team/deferred", &src).await;
    assert!(!first.unchanged);
    assert_eq!(first.record.unwrap().digest, Some(want));
    let dest = c.dir.path().join("dest");
    client
        .get(&key("team/deferred"), &dest, Progress::none())
        .await
        .unwrap();
    assert_eq!(fingerprint(&dest), fingerprint(&src));

    // The scan cache has the hash computed while sending: a scan reads nothing.
    let files: Vec<PathBuf> = std::fs::read_dir(cache.join("scan"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let mut scan_cache = kt_sync::ScanCache::load(&files[0]);
    kt_sync::scan(&src, &mut scan_cache).unwrap();
    assert_eq!(
        scan_cache.hashed, 0,
        "the put left the large file unknown to the cache"
    );
    let again = put(&client, "team/deferred", &src).await;
    assert!(again.unchanged);

    // A client without that cache is asked to hash the file the store has
    // (same path, size and mtime) rather than send it: nothing moves.
    let fresh = put(&c.client(), "team/deferred", &src).await;
    assert!(fresh.unchanged, "{:?}", fresh.stats);
    assert_eq!(fresh.stats.bytes_sent, 0);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_deferred_upload_resumes_and_sends_only_the_rest() {
    let mut c = Cluster::start().await;
    let src = c.dir.path().join("src");
    let size = 16 << 20;
    write_files(&src, &[("big", &bytes(21, size)), ("small", b"small")]);
    let want = hashed_digest(&src);
    let k = key("deferred/resume");
    let put = c.put_cut_by_store_restart(&k, &src, size / 2).await;
    let summary = put.await.unwrap().unwrap();
    assert!(!summary.unchanged);
    let again = c.store_metrics.bytes_in() as usize;
    assert!(
        again <= size / 2 + (2 << 20),
        "the restarted store received {again} bytes of a {size}-byte file"
    );
    let record = c.client().stat(&k).await.unwrap();
    assert_eq!(record.digest, Some(want));
    let dest = c.dir.path().join("dest");
    c.client().get(&k, &dest, Progress::none()).await.unwrap();
    assert_eq!(fingerprint(&dest), fingerprint(&src));
    c.stop().await;
}

/// Bytes a put has sent so far.
#[derive(Default)]
struct Sent(std::sync::atomic::AtomicUsize);

impl kt_client::progress::ProgressSink for Sent {
    fn start(&self, _bytes: u64, _files: u64) {}
    fn advance(&self, bytes: u64) {
        self.0
            .fetch_add(bytes as usize, std::sync::atomic::Ordering::SeqCst);
    }
    fn finish(&self) {}
}

/// A deferred file's hash is the root of what was read of it, and a
/// resumed upload does not read again the chunks the store kept: a file
/// rewritten while the store was away must not publish its first half old
/// and its second half new. The put fails naming it (or publishes the new
/// content whole), a get gives old or new content, and the next put
/// publishes the new content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_rewritten_between_attempts_is_never_published_torn() {
    use std::io::Write;
    let mut c = Cluster::start().await;
    let src = c.dir.path().join("src");
    let size = 16 << 20;
    let (old, new) = (bytes(31, size), bytes(32, size));
    write_files(&src, &[("big", &old)]);
    let k = key("deferred/torn");
    let sent = std::sync::Arc::new(Sent::default());
    let putting = {
        let (client, k, src) = (c.client(), k.clone(), src.clone());
        let progress = Progress::new(sent.clone());
        tokio::spawn(async move { client.put(&k, &src, PutOptions::default(), progress).await })
    };
    kt_tests::wait_until(
        "the put halfway",
        std::time::Duration::from_secs(60),
        || {
            let sent = sent.clone();
            async move { sent.0.load(std::sync::atomic::Ordering::SeqCst) >= size / 2 }
        },
    )
    .await;
    let addr = c.stop_store().await;
    // Other bytes of the same size, written in place (a checkpoint saved again).
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(src.join("big"))
        .unwrap();
    f.write_all(&new).unwrap();
    drop(f);
    c.start_store(addr).await;

    let outcome = putting.await.unwrap();
    match &outcome {
        Ok(s) => assert!(!s.unchanged),
        Err(e) => assert!(
            e.to_string().contains("\"big\" changed while it was sent"),
            "{e}"
        ),
    }
    let dest = c.dir.path().join("dest");
    let got = c.client().get(&k, &dest, Progress::none()).await;
    match got {
        Ok(_) => {
            let content = std::fs::read(dest.join("big")).unwrap();
            assert!(
                content == new || (content == old && outcome.is_err()),
                "the put published {} content that never was on disk",
                if outcome.is_ok() {
                    "(without error)"
                } else {
                    "(and failed)"
                }
            );
        }
        Err(e) => {
            assert!(outcome.is_err(), "the put succeeded, the get fails: {e}");
            assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
        }
    }
    // Put again: the new content, whole.
    let again = put(&c.client(), "deferred/torn", &src).await;
    assert!(outcome.is_ok() || !again.unchanged);
    let dest = c.dir.path().join("dest-again");
    c.client().get(&k, &dest, Progress::none()).await.unwrap();
    assert!(std::fs::read(dest.join("big")).unwrap() == new);
    c.stop().await;
}

/// The sync protocol spoken by hand, as a client that defers hashes.
struct Raw {
    http: reqwest::Client,
    store: String,
}

impl Raw {
    fn new(c: &Cluster) -> Raw {
        Raw {
            http: kt_api::client(),
            store: c.store_url(),
        }
    }

    /// Plans a put of `m` (the manifest with real hashes) under `k`, its
    /// `deferred` entries carrying the placeholder.
    async fn plan(&self, k: &str, m: &Manifest, deferred: &[u32]) -> reqwest::Response {
        let mut provisional = m.clone();
        for &i in deferred {
            let entry = provisional.entries.get_mut(i as usize);
            if let Some(e) = entry.filter(|e| e.kind == kt_types::EntryKind::File) {
                e.hash = Some(DEFERRED_HASH);
            }
        }
        let encoded = kt_types::codec::to_bytes(&provisional);
        let doc = kt_types::codec::document_with(
            &serde_json::json!({
                "key": k,
                "digest": kt_sync::digest_of_encoded(&encoded),
                "deferred": deferred,
            }),
            &encoded,
        );
        self.http
            .post(format!("{}{}", self.store, kt_types::paths::puts()))
            .bearer_auth(TOKEN)
            .body(doc)
            .send()
            .await
            .unwrap()
    }

    async fn session(&self, k: &str, m: &Manifest, deferred: &[u32]) -> PutPlan {
        let r = self.plan(k, m, deferred).await;
        assert!(r.status().is_success(), "{}", r.status());
        let plan: PutPlan = r.json().await.unwrap();
        assert!(plan.deferred && plan.session.is_some(), "{plan:?}");
        plan
    }

    /// Sends every chunk of `data` as entry `index`, chunk `bad` (if any)
    /// with a byte flipped.
    async fn chunks(&self, session: &str, index: u32, data: &[u8], bad: Option<u64>) {
        for n in 0..kt_sync::chunk::chunk_count(data.len() as u64, CHUNK) {
            let (off, len) = kt_sync::chunk::chunk_range(data.len() as u64, CHUNK, n).unwrap();
            let mut body = data[off as usize..(off + len) as usize].to_vec();
            if bad == Some(n) {
                body[0] ^= 1;
            }
            let r = self
                .http
                .put(format!(
                    "{}{}",
                    self.store,
                    kt_types::paths::put_chunk(session, index as usize, n)
                ))
                .bearer_auth(TOKEN)
                .body(body)
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success(), "chunk {n}: {}", r.status());
        }
    }

    /// Sends every file `plan` needs from `src` but entry `skip`: large
    /// ones in chunks, small ones in one batch.
    async fn others(&self, session: &str, plan: &PutPlan, src: &Path, m: &Manifest, skip: u32) {
        let mut items = Vec::new();
        for &i in plan.needed.iter().filter(|&&i| i != skip) {
            let e = &m.entries[i as usize];
            if e.size > CHUNK {
                let data = std::fs::read(src.join(&e.path)).unwrap();
                self.chunks(session, i, &data, None).await;
            } else {
                items.push(kt_sync::batch::SendItem {
                    index: i,
                    path: src.join(&e.path),
                    size: e.size,
                    entry_path: e.path.clone(),
                    data: None,
                    beneath: None,
                });
            }
        }
        if items.is_empty() {
            return;
        }
        let frames: Vec<bytes::Bytes> =
            futures::TryStreamExt::try_collect(kt_sync::batch::send_stream(items, None))
                .await
                .unwrap();
        let r = self
            .http
            .put(format!(
                "{}{}",
                self.store,
                kt_types::paths::put_batch(session)
            ))
            .bearer_auth(TOKEN)
            .body(frames.concat())
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.status());
    }

    async fn commit(&self, session: &str, body: Option<serde_json::Value>) -> reqwest::Response {
        let call = self
            .http
            .post(format!(
                "{}{}",
                self.store,
                kt_types::paths::put_commit(session)
            ))
            .bearer_auth(TOKEN);
        match body {
            Some(b) => call.json(&b),
            None => call,
        }
        .send()
        .await
        .unwrap()
    }
}

async fn error_of(r: reqwest::Response) -> (u16, ErrorBody) {
    (r.status().as_u16(), r.json().await.unwrap())
}

fn roots(index: u32, hash: Hash) -> serde_json::Value {
    serde_json::json!({ "roots": [{ "index": index, "hash": hash }] })
}

/// The manifest of `src` and the index of its `big.bin`.
fn scanned(src: &Path) -> (Manifest, u32) {
    let m = kt_sync::scan(src, &mut kt_sync::ScanCache::default()).unwrap();
    let i = m.entries.iter().position(|e| e.path == "big.bin").unwrap() as u32;
    (m, i)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_whose_roots_lie_publishes_nothing() {
    let c = Cluster::start().await;
    let src = c.dir.path().join("src");
    tree(&src, 3);
    let client = c.client();
    let k = "team/lied";
    put(&client, k, &src).await;
    let before = fingerprint(&src);

    // A new version whose big file changes (its size too: the store does
    // not ask to hash a file it may have).
    let next = c.dir.path().join("next");
    tree(&next, 4);
    let data = bytes(5, BIG + 1);
    std::fs::write(next.join("big.bin"), &data).unwrap();
    let (m, i) = scanned(&next);
    let raw = Raw::new(&c);
    let real = m.entries[i as usize].hash.unwrap();

    // A root that is not the content sent.
    let plan = raw.session(k, &m, &[i]).await;
    let session = plan.session.clone().unwrap();
    raw.chunks(&session, i, &data, None).await;
    raw.others(&session, &plan, &next, &m, i).await;
    let (status, body) = error_of(raw.commit(&session, Some(roots(i, Hash([9; 32])))).await).await;
    assert_eq!((status, body.error.code), (400, ErrorCode::HashMismatch));
    assert!(
        body.error.message.contains("nothing is published"),
        "{}",
        body.error.message
    );
    // The session is gone with its staging.
    let (status, _) = error_of(raw.commit(&session, Some(roots(i, real))).await).await;
    assert_eq!(status, 404);

    // Content that is not what the root says (one chunk altered on the way).
    let plan = raw.session(k, &m, &[i]).await;
    let session = plan.session.clone().unwrap();
    raw.chunks(&session, i, &data, Some(7)).await;
    raw.others(&session, &plan, &next, &m, i).await;
    let (status, body) = error_of(raw.commit(&session, Some(roots(i, real))).await).await;
    assert_eq!((status, body.error.code), (400, ErrorCode::HashMismatch));

    // The previous version is still the one served.
    let dest = c.dir.path().join("dest");
    client.get(&key(k), &dest, Progress::none()).await.unwrap();
    assert_eq!(fingerprint(&dest), before);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferred_entries_are_checked_and_their_roots_required() {
    let c = Cluster::start().await;
    let src = c.dir.path().join("src");
    tree(&src, 6);
    let (m, i) = scanned(&src);
    // A small file may be deferred too (it moves in a batch, hashed by the
    // store as it is written: `arriving.rs`).
    let dir = m.entries.iter().position(|e| e.path == "conf").unwrap() as u32;
    let raw = Raw::new(&c);
    let k = "team/checked";
    for (deferred, says) in [
        (vec![dir], "not a regular file"),
        (vec![999], "out of range"),
        (vec![i, i], "named twice"),
    ] {
        let (status, body) = error_of(raw.plan(k, &m, &deferred).await).await;
        assert_eq!(
            (status, body.error.code),
            (400, ErrorCode::InvalidRequest),
            "{deferred:?}"
        );
        assert!(
            body.error.message.contains(says),
            "{deferred:?}: {}",
            body.error.message
        );
    }

    let plan = raw.session(k, &m, &[i]).await;
    assert!(plan.needed.contains(&i));
    let session = plan.session.clone().unwrap();
    let data = std::fs::read(src.join("big.bin")).unwrap();
    raw.chunks(&session, i, &data, None).await;
    raw.others(&session, &plan, &src, &m, i).await;

    // A commit without the deferred root is refused; the upload stays open.
    let (status, body) = error_of(raw.commit(&session, None).await).await;
    assert_eq!((status, body.error.code), (400, ErrorCode::InvalidRequest));
    assert!(
        body.error.message.contains("commit without the root"),
        "{}",
        body.error.message
    );
    let real = m.entries[i as usize].hash.unwrap();
    let r = raw.commit(&session, Some(roots(i, real))).await;
    assert!(r.status().is_success(), "{}", r.status());
    let commit: CommitResponse = r.json().await.unwrap();
    assert_eq!(commit.record.digest, Some(kt_sync::manifest_digest(&m)));
    let dest = c.dir.path().join("dest");
    c.client()
        .get(&key(k), &dest, Progress::none())
        .await
        .unwrap();
    assert_eq!(fingerprint(&dest), fingerprint(&src));
    c.stop().await;
}
