//! The handlers end to end (plan, batch, chunks, commit on a store's
//! state over a temporary directory), and the fixtures the stage modules'
//! unit tests share.

use std::path::Path as FsPath;
use std::sync::Arc;

use axum::Extension;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use kt_service::ApiBytes;
use kt_types::api::{DEFERRED_HASH, PutPlan};
use kt_types::auth::Principal;
use kt_types::codec;
use kt_types::{Entry, EntryKind, ErrorCode, Hash, Key, Manifest};

use super::{batch, chunk, commit, plan};
use crate::session::PutSession;
use crate::state::{AppState, Shared};

pub(super) const CHUNK: u64 = 64 << 10;

/// The store's shared state over `data_dir`, as `server::start` builds
/// it (a metadata server that is not there: registrations fail).
fn shared(data_dir: &FsPath) -> AppState {
    let token = kt_service::Token::new("t").unwrap();
    let mut cfg = crate::Config::new(data_dir, "http://127.0.0.1:9", token.clone());
    cfg.chunk_size = CHUNK;
    cfg.reserve = Some(0);
    let keys = Arc::new(crate::keys::Keys::open(data_dir, cfg.session_ttl).unwrap());
    let registrar =
        Arc::new(crate::registrar::Registrar::new(&cfg.metadata_url, "http://s", token).unwrap());
    let metrics = Arc::new(kt_service::Metrics::new());
    let reads = kt_service::reads::Reads::new(
        crate::versions::StoreVersions {
            keys: keys.clone(),
            chunk_size: CHUNK,
        },
        registrar.clone(),
        metrics.clone(),
        cfg.lease_ttl,
    );
    Arc::new(Shared {
        keys,
        puts: Default::default(),
        reads,
        metrics,
        registrar,
        url: "http://s".into(),
        cfg,
    })
}

async fn plan_of(s: &AppState, doc: &[u8]) -> (PutPlan, Arc<PutSession>) {
    let p = plan(
        State(s.clone()),
        Extension(Principal::admin()),
        ApiBytes(Bytes::copy_from_slice(doc), None),
    )
    .await
    .unwrap()
    .0;
    let id = p.session.clone().unwrap();
    let sess = s.puts.lock().unwrap().get(&id).cloned().unwrap();
    (p, sess)
}

async fn send_chunks(s: &AppState, id: &str, index: u32, data: &[u8], chunks: u64) {
    for n in 0..chunks {
        let (off, len) = kt_sync::chunk::chunk_range(data.len() as u64, CHUNK, n).unwrap();
        let body = Body::from(data[off as usize..(off + len) as usize].to_vec());
        chunk(State(s.clone()), Path((id.to_owned(), index, n)), body)
            .await
            .unwrap();
    }
}

/// The chaos run's violation: a store restarted in the middle of an
/// upload keeps its staging version for resuming; the put planned again
/// adopts it (nothing left to send) and commits. A second plan of the
/// same tree that came while that commit was publishing (its session
/// already out of the sessions map, the resume marker not yet removed)
/// adopted the same version, truncated its file and wrote it again —
/// into the version just published — then published it a second time.
/// A staging version belongs to one upload from plan to end of commit.
#[tokio::test(flavor = "multi_thread")]
async fn a_staging_version_is_never_adopted_by_two_uploads() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let big: Vec<u8> = (0..4 * CHUNK as u32 + 100)
        .map(|i| (i % 251) as u8)
        .collect();
    std::fs::write(src.join("large-0.bin"), &big).unwrap();
    let m = kt_sync::scan(&src, &mut kt_sync::ScanCache::default()).unwrap();
    let index = m
        .entries
        .iter()
        .position(|e| e.path == "large-0.bin")
        .unwrap() as u32;
    let chunks = kt_sync::chunk::chunk_count(big.len() as u64, CHUNK);
    let header = serde_json::json!({ "key": "chaos/s2", "digest": kt_sync::manifest_digest(&m) });
    let doc = codec::encode_document(&header, &m);
    let data = d.path().join("store");

    // A store killed after every chunk arrived, before the commit.
    let s = shared(&data);
    let (p, _) = plan_of(&s, &doc).await;
    send_chunks(&s, p.session.as_deref().unwrap(), index, &big, chunks).await;
    drop(s);

    // Restarted: the put planned again resumes, with nothing to send.
    let s = shared(&data);
    let (a, sess_a) = plan_of(&s, &doc).await;
    assert!(a.needed.is_empty(), "{a:?}");
    let a_id = a.session.unwrap();
    // Its commit begins: the session leaves the map (and stays alive
    // while the commit publishes it).
    s.puts.lock().unwrap().remove(&a_id).unwrap();
    // Meanwhile the same tree is planned again (a retry, another putter).
    let (b, sess_b) = plan_of(&s, &doc).await;
    assert_ne!(
        sess_b.version, sess_a.version,
        "two uploads adopted one staging version"
    );
    assert_eq!(b.needed, [index], "a fresh staging version needs the file");
    let a_version = sess_a.version.clone();

    // A's commit goes on and publishes (the metadata server is not
    // there: the record fails, the data is published).
    s.puts.lock().unwrap().insert(a_id.clone(), sess_a);
    let committed = commit(
        State(s.clone()),
        Extension(Principal::admin()),
        Path(a_id),
        Bytes::new(),
    )
    .await;
    assert!(committed.is_err_and(|e| e.code == ErrorCode::Unavailable));
    let dir = s.keys.dir_of(&Key::parse("chaos/s2").unwrap());
    assert_eq!(dir.current().unwrap().as_deref(), Some(a_version.as_str()));
    let published = dir.version_path(&a_version).join("large-0.bin");
    assert_eq!(std::fs::read(&published).unwrap(), big);

    // B uploads everything into its own version: the published file
    // is never written again.
    let b_id = b.session.unwrap();
    send_chunks(&s, &b_id, index, &big, chunks).await;
    assert_eq!(std::fs::read(&published).unwrap(), big);
    drop(sess_b);
    let committed = commit(
        State(s.clone()),
        Extension(Principal::admin()),
        Path(b_id),
        Bytes::new(),
    )
    .await;
    assert!(committed.is_err_and(|e| e.code == ErrorCode::Unavailable));
    let current = dir.current().unwrap().unwrap();
    assert_ne!(current, a_version);
    assert_eq!(
        std::fs::read(dir.version_path(&current).join("large-0.bin")).unwrap(),
        big
    );
}

/// Puts the tree at `src` under `key` through plan, batch and commit
/// (the metadata server is not there: the record fails, the data is
/// published); returns the session (its staging version published).
async fn put_tree(s: &AppState, key: &str, src: &FsPath) -> Arc<PutSession> {
    let m = kt_sync::scan(src, &mut kt_sync::ScanCache::default()).unwrap();
    let header = serde_json::json!({ "key": key, "digest": kt_sync::manifest_digest(&m) });
    let (p, sess) = plan_of(s, &codec::encode_document(&header, &m)).await;
    send_and_commit(s, &p, src, &m).await;
    sess
}

async fn send_and_commit(s: &AppState, p: &PutPlan, src: &FsPath, m: &Manifest) {
    let id = p.session.clone().unwrap();
    let items = p
        .needed
        .iter()
        .map(|&i| {
            let e = &m.entries[i as usize];
            kt_sync::batch::SendItem {
                index: i,
                path: src.join(&e.path),
                size: e.size,
                entry_path: e.path.clone(),
                data: None,
                beneath: None,
            }
        })
        .collect();
    let body = Body::from_stream(kt_sync::batch::send_stream(items, None));
    batch(State(s.clone()), Path(id.clone()), body)
        .await
        .unwrap();
    let committed = commit(
        State(s.clone()),
        Extension(Principal::admin()),
        Path(id),
        Bytes::new(),
    )
    .await;
    assert!(committed.is_err_and(|e| e.code == ErrorCode::Unavailable));
}

/// What is under `root` by path: each file's content, None for a
/// directory.
fn contents(root: &FsPath) -> std::collections::BTreeMap<String, Option<Vec<u8>>> {
    let mut out = std::collections::BTreeMap::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        for d in std::fs::read_dir(&dir).unwrap() {
            let p = d.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_owned();
            if p.is_dir() {
                dirs.push(p);
                out.insert(rel, None);
            } else {
                out.insert(rel, Some(std::fs::read(&p).unwrap()));
            }
        }
    }
    out
}

/// A source tree of `n` small files in two directories.
fn small_tree(src: &FsPath, n: usize) {
    for d in ["a", "b"] {
        std::fs::create_dir_all(src.join(d)).unwrap();
    }
    for i in 0..n {
        let dir = if i % 2 == 0 { "a" } else { "b" };
        std::fs::write(src.join(format!("{dir}/f{i}")), format!("file {i}")).unwrap();
    }
}

async fn spare_of(s: &AppState, key: &str) -> Option<String> {
    let state = s.keys.state(&Key::parse(key).unwrap());
    let st = state.lock().await;
    st.spare.as_ref().map(|sp| sp.version.clone())
}

fn ino(p: &FsPath) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).unwrap().ino()
}

/// The version a put supersedes, no reader holding it, is kept; the
/// next put stages in it (its directory renamed, only what differs
/// fixed up) and publishes the tree the source has, the version it was
/// staged against untouched.
#[tokio::test(flavor = "multi_thread")]
async fn a_put_stages_in_the_version_it_superseded_two_puts_back() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    small_tree(&src, 40);
    let s = shared(&d.path().join("store"));
    let dir = s.keys.dir_of(&Key::parse("t/r").unwrap());
    let v1 = put_tree(&s, "t/r", &src).await.version.clone();
    assert_eq!(spare_of(&s, "t/r").await, None);
    std::fs::write(src.join("a/f0"), "changed once").unwrap();
    let v2 = put_tree(&s, "t/r", &src).await.version.clone();
    assert_eq!(spare_of(&s, "t/r").await.as_deref(), Some(v1.as_str()));
    let v1_dir = ino(&dir.version_path(&v1));
    let v2_tree = contents(&dir.version_path(&v2));

    std::fs::write(src.join("b/f1"), "changed twice").unwrap();
    std::fs::write(src.join("b/new"), "new").unwrap();
    std::fs::remove_file(src.join("a/f2")).unwrap();
    let m = kt_sync::scan(&src, &mut kt_sync::ScanCache::default()).unwrap();
    let header = serde_json::json!({ "key": "t/r", "digest": kt_sync::manifest_digest(&m) });
    let (p, sess) = plan_of(&s, &codec::encode_document(&header, &m)).await;
    assert_eq!(
        ino(&dir.version_path(&sess.version)),
        v1_dir,
        "not staged in v1"
    );
    assert!(!dir.version_path(&v1).exists());
    assert_eq!(spare_of(&s, "t/r").await, None);
    let sent: Vec<&str> = p
        .needed
        .iter()
        .map(|&i| m.entries[i as usize].path.as_str())
        .collect();
    assert_eq!(sent, ["b/f1", "b/new"]);
    send_and_commit(&s, &p, &src, &m).await;
    let v3 = sess.version.clone();
    assert_eq!(dir.current().unwrap().as_deref(), Some(v3.as_str()));
    assert_eq!(contents(&dir.version_path(&v3)), contents(&src));
    assert_eq!(contents(&dir.version_path(&v2)), v2_tree);
    assert_eq!(spare_of(&s, "t/r").await.as_deref(), Some(v2.as_str()));
}

/// A superseded version a reader holds is never a spare: the next put
/// stages afresh, the reader's version stays whole until it is
/// closed, then goes.
#[tokio::test(flavor = "multi_thread")]
async fn a_version_a_reader_holds_is_never_staged_in() {
    use kt_service::reads::ReadSource;
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    small_tree(&src, 40);
    let s = shared(&d.path().join("store"));
    let key = Key::parse("t/held").unwrap();
    let dir = s.keys.dir_of(&key);
    let v1 = put_tree(&s, "t/held", &src).await.version.clone();
    let source = crate::versions::StoreVersions {
        keys: s.keys.clone(),
        chunk_size: CHUNK,
    };
    let read = source.open(&key).await.unwrap();
    assert_eq!(read.version, v1);
    let held = contents(&dir.version_path(&v1));
    let v1_dir = ino(&dir.version_path(&v1));

    std::fs::write(src.join("a/f0"), "changed once").unwrap();
    put_tree(&s, "t/held", &src).await;
    assert_eq!(spare_of(&s, "t/held").await, None, "v1 is read");
    std::fs::write(src.join("a/f0"), "changed twice").unwrap();
    let v3 = put_tree(&s, "t/held", &src).await;
    assert_ne!(ino(&dir.version_path(&v3.version)), v1_dir);
    assert_eq!(contents(&dir.version_path(&v1)), held);
    assert_eq!(contents(&dir.version_path(&v3.version)), contents(&src));

    source.close(&read).await;
    assert!(!dir.version_path(&v1).exists(), "v1 outlived its reader");
}

/// A put whose staging in the spare fails midway (a file to remove is
/// a directory now) stages afresh and publishes the right tree; one
/// that crashed midway leaves the current version as it was, the next
/// start removes what it left, and the next put is right.
#[tokio::test(flavor = "multi_thread")]
async fn a_staging_that_fails_or_crashes_midway_leaves_current_and_the_next_put_right() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    let data = d.path().join("store");
    small_tree(&src, 40);
    let s = shared(&data);
    let dir = s.keys.dir_of(&Key::parse("t/crash").unwrap());
    // Each put changes a/f0: the spare's a/f0 is always to be removed.
    let spoil = |v: &str| {
        let p = dir.version_path(v).join("a/f0");
        std::fs::remove_file(&p).unwrap();
        std::fs::create_dir(&p).unwrap();
        std::fs::write(p.join("in-the-way"), b"x").unwrap();
    };
    let v1 = put_tree(&s, "t/crash", &src).await.version.clone();
    std::fs::write(src.join("a/f0"), "2").unwrap();
    let v2 = put_tree(&s, "t/crash", &src).await.version.clone();
    assert_eq!(spare_of(&s, "t/crash").await.as_deref(), Some(v1.as_str()));
    spoil(&v1);

    // A failure midway: staged afresh, published right.
    std::fs::write(src.join("a/f0"), "3").unwrap();
    let v3 = put_tree(&s, "t/crash", &src).await.version.clone();
    assert_eq!(dir.current().unwrap().as_deref(), Some(v3.as_str()));
    assert_eq!(contents(&dir.version_path(&v3)), contents(&src));
    assert!(!dir.version_path(&v1).exists());

    // A crash midway: staging in v2 stopped where it failed.
    assert_eq!(spare_of(&s, "t/crash").await, Some(v2.clone()));
    spoil(&v2);
    let current = contents(&dir.version_path(&v3));
    std::fs::write(src.join("a/f0"), "4").unwrap();
    let m4 = kt_sync::scan(&src, &mut kt_sync::ScanCache::default()).unwrap();
    let state = s.keys.state(&Key::parse("t/crash").unwrap());
    let (spare, base) = {
        let mut st = state.lock().await;
        (st.spare.take().unwrap(), st.current.clone().unwrap())
    };
    let staging = dir.stage().unwrap();
    let base_root = dir.version_path(&base.version);
    let fixed = crate::versions::recycle(
        &dir,
        &staging,
        &spare,
        &m4,
        Some((base_root.as_path(), &*base.meta.manifest)),
    );
    assert!(fixed.is_err(), "{fixed:?}");
    drop((state, s));

    // Restarted.
    let s = shared(&data);
    assert_eq!(dir.current().unwrap().as_deref(), Some(v3.as_str()));
    assert!(!dir.version_path(&staging).exists());
    assert_eq!(contents(&dir.version_path(&v3)), current);
    let v4 = put_tree(&s, "t/crash", &src).await.version.clone();
    assert_eq!(dir.current().unwrap().as_deref(), Some(v4.as_str()));
    assert_eq!(contents(&dir.version_path(&v4)), contents(&src));
}

/// A manifest of a directory, a small file and a large one (deferred:
/// its hash the placeholder).
pub(super) fn deferring_manifest() -> Manifest {
    let file = |path: &str, size: u64, hash: Hash| Entry {
        path: path.into(),
        kind: EntryKind::File,
        size,
        mode: 0o644,
        mtime: 1_700_000_000,
        mtime_nsec: 5,
        hash: Some(hash),
        target: None,
    };
    Manifest {
        root: kt_types::RootKind::Dir,
        entries: vec![
            Entry {
                path: "d".into(),
                kind: EntryKind::Dir,
                size: 0,
                mode: 0o755,
                mtime: 0,
                mtime_nsec: 0,
                hash: None,
                target: None,
            },
            file("d/big", 3 * CHUNK, DEFERRED_HASH),
            file("d/small", 10, Hash([1; 32])),
            file("d/sized", CHUNK, DEFERRED_HASH),
        ],
    }
}
