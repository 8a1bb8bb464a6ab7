//! Rank-aware reads of a dataset below a prefix with the real servers and
//! client: 4 ranks stream disjoint, byte-balanced shares whose union is the
//! dataset, never holding more than their budget on disk; a stream resumes
//! from a position; a peer lost mid-stream fails over to the store;
//! `get_share` places a share as a prefix get would; a file whose size
//! differs from the listing is refused before a byte moves; and two keys
//! whose files would take one place are streamed apart, or refused by name
//! by `get_share`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kt_client::Progress;
use kt_client::stream::{DatasetFile, StreamOptions};
use kt_tests::{CHUNK, Cluster, TOKEN, bytes, wait_until};
use kt_types::api::{PutOptions, RegisterKey};
use kt_types::shard::{Shard, ShareSpec};
use kt_types::{Key, KeyPrefix};

const PREFIX: &str = "train/shards";
const WAIT: Duration = Duration::from_secs(60);

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

fn prefix() -> KeyPrefix {
    KeyPrefix::parse(PREFIX).unwrap()
}

fn spec(rank: u32, world: u32) -> ShareSpec {
    ShareSpec {
        shard: Shard::new(rank, world).unwrap(),
        epoch: 0,
        shuffle: false,
    }
}

/// 64 files below the prefix: 48 single-file keys (some of several chunks)
/// and two directory keys of 8 files each. Returns each file's contents by
/// its path below the prefix.
async fn dataset(c: &Cluster) -> BTreeMap<String, Vec<u8>> {
    let client = c.client_with(|cfg| cfg.serve_copies = false);
    let mut want = BTreeMap::new();
    let src = c.dir.path().join("src");
    for i in 0..48u64 {
        let len = match i % 4 {
            0 => 3 * CHUNK as usize + 17 * i as usize,
            1 => 1000 + 37 * i as usize,
            2 => CHUNK as usize / 2,
            _ => 10 * i as usize,
        };
        let data = bytes(i, len);
        let name = format!("part-{i:03}.bin");
        let file = src.join(&name);
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(&file, &data).unwrap();
        client
            .put(
                &key(&format!("{PREFIX}/{name}")),
                &file,
                PutOptions::default(),
                Progress::none(),
            )
            .await
            .unwrap();
        want.insert(name, data);
    }
    for t in 0..2u64 {
        let root = src.join(format!("tree-{t}"));
        for j in 0..8u64 {
            let data = bytes(100 + t * 8 + j, 5000 + 900 * j as usize);
            let entry = format!("d{}/f-{j}.bin", j % 3);
            std::fs::create_dir_all(root.join(format!("d{}", j % 3))).unwrap();
            std::fs::write(root.join(&entry), &data).unwrap();
            want.insert(format!("trees/t{t}/{entry}"), data);
        }
        client
            .put(
                &key(&format!("{PREFIX}/trees/t{t}")),
                &root,
                PutOptions::default(),
                Progress::none(),
            )
            .await
            .unwrap();
    }
    assert_eq!(want.len(), 64);
    want
}

/// Samples `dir`'s bytes on disk on a thread of its own until stopped:
/// the most seen.
struct Sampler {
    stop: Arc<AtomicBool>,
    max: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(dir: &Path) -> Sampler {
        let (stop, max) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let (s, m, dir) = (stop.clone(), max.clone(), dir.to_owned());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                m.fetch_max(kt_sync::du::disk_bytes(&dir), Ordering::SeqCst);
                std::thread::yield_now();
            }
        });
        Sampler {
            stop,
            max,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        self.max.load(Ordering::SeqCst)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_ranks_stream_disjoint_balanced_shares_within_their_budget() {
    let c = Cluster::start().await;
    let want = dataset(&c).await;
    let largest = want.values().map(Vec::len).max().unwrap() as u64;
    // About four of the largest files: fetching ahead is bounded by it.
    let budget = 4 * largest;
    let mut seen: BTreeMap<String, u32> = BTreeMap::new();
    let mut loads = Vec::new();
    for rank in 0..4 {
        let client = c.client_with(|cfg| cfg.serve_copies = false);
        let dir = c.dir.path().join(format!("stream-{rank}"));
        let mut opts = StreamOptions::new(spec(rank, 4), budget);
        opts.dir = Some(dir.clone());
        let sampler = Sampler::start(&dir);
        let mut s = client.stream_share(&prefix(), opts).await.unwrap();
        let share: Vec<DatasetFile> = s.share().to_vec();
        loads.push(share.iter().map(|f| f.size).sum::<u64>());
        let mut order = Vec::new();
        while let Some(f) = s.next().await {
            let f = f.unwrap();
            assert_eq!(f.position, order.len());
            let data = f.bytes().await.unwrap();
            assert_eq!(
                Some(&data),
                want.get(&f.file.path),
                "{} differs",
                f.file.path
            );
            // In the stream's own directory inside `dir`.
            assert!(s.dir().starts_with(&dir) && s.dir() != dir);
            assert_eq!(f.path, s.dir().join(&f.file.path));
            assert!(kt_sync::du::disk_bytes(&dir) <= budget);
            order.push(f.file.path.clone());
            *seen.entry(f.file.path.clone()).or_default() += 1;
            drop(f);
            assert_eq!(s.position(), order.len());
        }
        let most = sampler.finish();
        assert_eq!(
            order,
            share.iter().map(|f| f.path.clone()).collect::<Vec<_>>()
        );
        assert!(s.peak_held() <= budget, "{} > {budget}", s.peak_held());
        assert!(
            most <= budget,
            "rank {rank}: {most} bytes on disk > {budget}"
        );
        assert!(most > 0, "rank {rank}: the sampler saw nothing");
        // Every consumed file was deleted.
        assert_eq!(kt_sync::du::disk_bytes(&dir), 0);
        let own = s.dir().to_owned();
        drop(s);
        wait_until("the stream's directory removed", WAIT, || async {
            !own.exists()
        })
        .await;
    }
    // Disjoint, and together the whole dataset; balanced by bytes.
    assert_eq!(
        seen.keys().cloned().collect::<BTreeSet<_>>(),
        want.keys().cloned().collect::<BTreeSet<_>>()
    );
    assert!(seen.values().all(|&n| n == 1), "{seen:?}");
    let (max, min) = (loads.iter().max().unwrap(), loads.iter().min().unwrap());
    assert!(max - min <= largest, "loads {loads:?}");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_resumes_from_a_position_in_the_same_shuffled_order() {
    let c = Cluster::start().await;
    let want = dataset(&c).await;
    let client = c.client_with(|cfg| cfg.serve_copies = false);
    let shuffled = ShareSpec {
        epoch: 3,
        shuffle: true,
        ..spec(1, 4)
    };
    let mut first = client
        .stream_share(&prefix(), StreamOptions::new(shuffled, 1 << 20))
        .await
        .unwrap();
    let full: Vec<String> = first.share().iter().map(|f| f.path.clone()).collect();
    let plain = client.share_of(&prefix(), &spec(1, 4)).await.unwrap().0;
    assert_ne!(
        full,
        plain.iter().map(|f| f.path.clone()).collect::<Vec<_>>()
    );
    let mut got = Vec::new();
    for _ in 0..5 {
        let f = first.next().await.unwrap().unwrap();
        got.push(f.file.path.clone());
    }
    let at = first.position();
    assert_eq!(at, 5);
    let dir = first.dir().to_owned();
    drop(first);
    // The stream's own directory goes with it (once its fetches stopped).
    wait_until("the stream's directory removed", WAIT, || async {
        !dir.exists()
    })
    .await;
    let mut opts = StreamOptions::new(shuffled, 1 << 20);
    opts.start = at;
    let mut again = client.stream_share(&prefix(), opts).await.unwrap();
    assert_eq!(again.position(), 5);
    while let Some(f) = again.next().await {
        let f = f.unwrap();
        assert_eq!(Some(&f.bytes().await.unwrap()), want.get(&f.file.path));
        got.push(f.file.path.clone());
    }
    assert_eq!(got, full);
    // A start past the end is refused.
    let mut past = StreamOptions::new(shuffled, 1 << 20);
    past.start = full.len() + 1;
    let e = client.stream_share(&prefix(), past).await.unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_peer_lost_mid_stream_fails_over_to_the_store() {
    let c = Cluster::start().await;
    let want = dataset(&c).await;
    let total: u64 = want.values().map(|d| d.len() as u64).sum();
    // A getter whose agent serves its copies: every key gets a peer.
    let agent = c.start_agent("pod-peer").await;
    let sock = agent.socket().to_owned();
    let getter = c.client_with(|cfg| {
        cfg.serve_copies = true;
        cfg.agent_socket = sock;
    });
    getter
        .get_prefix(
            &prefix(),
            &c.dir.path().join("peer-copy"),
            &Default::default(),
        )
        .await
        .unwrap();
    let client = c.client_with(|cfg| cfg.serve_copies = false);
    wait_until("every key served by the peer", WAIT, || async {
        let listed = client.ls_below(&prefix()).await.unwrap();
        listed.entries.iter().all(|e| {
            e.record
                .as_ref()
                .is_none_or(|r| r.peers.iter().any(|p| p.id == "pod-peer"))
        })
    })
    .await;
    let before = c.store_metrics.bytes_out();
    let largest = want.values().map(Vec::len).max().unwrap() as u64;
    let mut s = client
        .stream_share(&prefix(), StreamOptions::new(spec(0, 1), 2 * largest))
        .await
        .unwrap();
    let mut agent = Some(agent);
    let mut n = 0;
    while let Some(f) = s.next().await {
        let f = f.unwrap();
        assert_eq!(Some(&f.bytes().await.unwrap()), want.get(&f.file.path));
        n += 1;
        if n == 3
            && let Some(a) = agent.take()
        {
            a.stop().await;
        }
    }
    assert_eq!(n, 64);
    let from_store = c.store_metrics.bytes_out() - before;
    // Peers first, then the store once the peer was gone.
    assert!(
        from_store > 0,
        "the store served nothing after the peer left"
    );
    assert!(
        from_store < total,
        "the store served everything ({from_store} of {total}): the peer was never read"
    );
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_share_get_places_only_its_files_and_refuses_bad_shards() {
    let c = Cluster::start().await;
    let want = dataset(&c).await;
    let client = c.client_with(|cfg| cfg.serve_copies = false);
    let dest = c.dir.path().join("dest");
    let mut all = BTreeSet::new();
    for rank in 0..3 {
        let got = client
            .get_share(&prefix(), &spec(rank, 3), &dest)
            .await
            .unwrap();
        for f in &got.files {
            assert_eq!(
                std::fs::read(dest.join(&f.path)).ok().as_ref(),
                want.get(&f.path),
                "{}",
                f.path
            );
            assert!(all.insert(f.path.clone()), "{} twice", f.path);
        }
    }
    assert_eq!(all, want.keys().cloned().collect());
    // Rank 0 of 3 again: what is there is kept, nothing moves.
    let again = client
        .get_share(&prefix(), &spec(0, 3), &dest)
        .await
        .unwrap();
    let moved: u64 = again.gets.iter().map(|(_, s)| s.stats.bytes_sent).sum();
    assert_eq!(moved, 0);
    let bad = ShareSpec {
        shard: Shard { rank: 3, world: 3 },
        ..spec(0, 3)
    };
    let e = client.get_share(&prefix(), &bad, &dest).await.unwrap_err();
    assert!(e.to_string().contains("not below the world size"), "{e}");
    let e = client
        .get_share(
            &KeyPrefix::parse("nothing/here").unwrap(),
            &spec(0, 1),
            &dest,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(kt_types::ErrorCode::NotFound));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_into_a_directory_leaves_what_was_there() {
    let c = Cluster::start().await;
    let want = dataset(&c).await;
    let client = c.client_with(|cfg| cfg.serve_copies = false);
    // An earlier copy of the whole dataset, then a stream into it.
    let dir = c.dir.path().join("copy");
    client
        .get_share(&prefix(), &spec(0, 1), &dir)
        .await
        .unwrap();
    let mut opts = StreamOptions::new(spec(0, 1), 1 << 30);
    opts.dir = Some(dir.clone());
    let mut s = client.stream_share(&prefix(), opts).await.unwrap();
    let mut n = 0;
    while let Some(f) = s.next().await {
        let f = f.unwrap();
        assert_eq!(Some(&f.bytes().await.unwrap()), want.get(&f.file.path));
        n += 1;
    }
    assert_eq!(n, want.len());
    drop(s);
    // Every file of the copy is still there, unchanged.
    for (path, data) in &want {
        assert_eq!(
            std::fs::read(dir.join(path)).ok().as_ref(),
            Some(data),
            "{path}"
        );
    }
    c.stop().await;
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_share_get_never_writes_through_a_symlinked_directory() {
    let c = Cluster::start().await;
    let want = dataset(&c).await;
    let client = c.client_with(|cfg| cfg.serve_copies = false);
    let dest = c.dir.path().join("dest");
    let outside = c.dir.path().join("outside");
    std::fs::create_dir_all(dest.join("trees/t0")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    // A directory of the tree key is a link out of the destination.
    std::os::unix::fs::symlink(&outside, dest.join("trees/t0/d1")).unwrap();
    client
        .get_share(&prefix(), &spec(0, 1), &dest)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        0,
        "a file was written through the link"
    );
    assert!(
        std::fs::symlink_metadata(dest.join("trees/t0/d1"))
            .unwrap()
            .is_dir()
    );
    for (path, data) in &want {
        assert_eq!(
            std::fs::read(dest.join(path)).ok().as_ref(),
            Some(data),
            "{path}"
        );
    }
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_yields_a_file_whose_place_is_a_directory_where_it_lies() {
    let c = Cluster::start().await;
    let client = c.client_with(|cfg| cfg.serve_copies = false);
    // Keys `x` and `x/y`: once `x/y` is placed, `x`'s place is a directory.
    let src = c.dir.path().join("nested-src");
    std::fs::create_dir_all(&src).unwrap();
    let mut want = BTreeMap::new();
    for (n, name) in ["x", "x/y"].into_iter().enumerate() {
        let data = bytes(200 + n as u64, 3000 + n);
        let file = src.join(format!("f{n}"));
        std::fs::write(&file, &data).unwrap();
        client
            .put(
                &key(&format!("nested/keys/{name}")),
                &file,
                PutOptions::default(),
                Progress::none(),
            )
            .await
            .unwrap();
        want.insert(name.to_owned(), data);
    }
    let nested = KeyPrefix::parse("nested/keys").unwrap();
    // An order that reads `x/y` first.
    let mut chosen = None;
    for epoch in 0..64 {
        let s = ShareSpec {
            epoch,
            shuffle: true,
            ..spec(0, 1)
        };
        let (order, _) = client.share_of(&nested, &s).await.unwrap();
        if order.first().is_some_and(|f| f.path == "x/y") {
            chosen = Some(s);
            break;
        }
    }
    let mut opts = StreamOptions::new(chosen.expect("no epoch reads x/y first"), 1 << 20);
    opts.ahead = 1;
    let mut s = client.stream_share(&nested, opts).await.unwrap();
    let mut got = BTreeMap::new();
    while let Some(f) = s.next().await {
        let f = f.unwrap();
        assert!(f.path.is_file(), "{} is no file", f.path.display());
        got.insert(f.file.path.clone(), f.bytes().await.unwrap());
    }
    assert_eq!(got, want);
    assert_eq!(s.held(), 0);
    c.stop().await;
}

/// Puts `data` as the single-file key `k`, from a source file named `name`.
async fn put_file(c: &Cluster, k: &str, name: &str, data: &[u8]) {
    let src = c.dir.path().join("src-files").join(k.replace('/', "_"));
    std::fs::create_dir_all(&src).unwrap();
    let file = src.join(name);
    std::fs::write(&file, data).unwrap();
    c.client_with(|cfg| cfg.serve_copies = false)
        .put(&key(k), &file, PutOptions::default(), Progress::none())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_file_larger_than_listed_is_refused_before_a_byte_moves() {
    let c = Cluster::start().await;
    let big = bytes(300, 4 << 20);
    put_file(&c, "sized/keys/big", "big.bin", &big).await;
    let client = c.client_with(|cfg| cfg.serve_copies = false);
    let record = client.stat(&key("sized/keys/big")).await.unwrap();
    // The same version and digest registered again with a false size, as
    // a registrant may (the metadata server stores the size it is told).
    let reg = RegisterKey {
        locale: record.locale,
        source: record.source.clone(),
        holder: None,
        version: record.version.clone(),
        is_dir: false,
        size: 1,
        files: 1,
        tensors: None,
        digest: record.digest,
        options: PutOptions::default(),
        only_if: None,
    };
    let resp = kt_api::client()
        .put(format!("{}/api/v1/keys/sized/keys/big", c.metadata_url()))
        .bearer_auth(TOKEN)
        .json(&reg)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    assert_eq!(client.stat(&key("sized/keys/big")).await.unwrap().size, 1);
    let sized = KeyPrefix::parse("sized/keys").unwrap();
    let before = c.store_metrics.bytes_out();
    let mut s = client
        .stream_share(&sized, StreamOptions::new(spec(0, 1), 1 << 20))
        .await
        .unwrap();
    let gauge = s.gauge();
    let e = s.next().await.unwrap().unwrap_err();
    let text = e.to_string();
    assert!(text.contains(&format!("{} bytes", big.len())), "{text}");
    assert!(text.contains("1 bytes when listed"), "{text}");
    assert!(text.contains("changed since it was listed"), "{text}");
    assert!(!e.is_source_failure(), "{e:?}");
    assert!(gauge.peak() <= 1 << 20, "peak {}", gauge.peak());
    assert_eq!(kt_sync::du::disk_bytes(s.dir()), 0);
    // The manifest was read; none of the file's bytes were sent.
    let sent = c.store_metrics.bytes_out() - before;
    assert!(sent < 64 << 10, "the store sent {sent} bytes");
    // A share get is refused the same way.
    let dest = c.dir.path().join("sized-dest");
    let e = client
        .get_share(&sized, &spec(0, 1), &dest)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("changed since it was listed"), "{e}");
    assert_eq!(kt_sync::du::disk_bytes(&dest), 0);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_keys_whose_files_take_one_place_stream_apart_and_a_share_get_refuses_them() {
    let c = Cluster::start().await;
    // Key `a` is a file named `b`: placed where key `a/b`'s file lies.
    let (outer, inner) = (bytes(400, 70_000), bytes(401, 50_000));
    put_file(&c, "clash/keys/a", "b", &outer).await;
    put_file(&c, "clash/keys/a/b", "inner.bin", &inner).await;
    let want = BTreeMap::from([("a".to_owned(), outer), ("a/b".to_owned(), inner)]);
    let client = c.client_with(|cfg| cfg.serve_copies = false);
    let clash = KeyPrefix::parse("clash/keys").unwrap();
    for epoch in 0..4 {
        let order = ShareSpec {
            epoch,
            shuffle: true,
            ..spec(0, 1)
        };
        let mut s = client
            .stream_share(&clash, StreamOptions::new(order, 1 << 20))
            .await
            .unwrap();
        // Both fetched before either is dropped: each keeps its own bytes.
        let mut held = Vec::new();
        while let Some(f) = s.next().await {
            held.push(f.unwrap());
        }
        assert_eq!(held.len(), 2);
        assert_ne!(held[0].path(), held[1].path());
        for f in &held {
            assert_eq!(
                Some(&f.bytes().await.unwrap()),
                want.get(&f.file.path),
                "{}",
                f.file.path
            );
        }
        // Dropping one leaves the other's file.
        let last = held.pop().unwrap();
        drop(held);
        assert_eq!(
            Some(&last.bytes().await.unwrap()),
            want.get(&last.file.path)
        );
        drop(last);
        assert_eq!(s.held(), 0);
    }
    let dest = c.dir.path().join("clash-dest");
    let e = client
        .get_share(&clash, &spec(0, 1), &dest)
        .await
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("a (key clash/keys/a) and a/b (key clash/keys/a/b)"),
        "{text}"
    );
    assert!(!dest.exists(), "a refused share get placed something");
    c.stop().await;
}
