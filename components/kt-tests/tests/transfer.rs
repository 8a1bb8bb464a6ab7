//! Round trips and incremental syncs over real servers.

use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::Path;

use filetime::FileTime;
use kt_client::Progress;
use kt_tests::{CHUNK, Cluster, bytes, fingerprint, write_files};
use kt_types::api::PutOptions;
use kt_types::{Key, RootKind};

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

/// A tree with everything fidelity must cover.
fn rich_tree(root: &Path) {
    write_files(
        root,
        &[
            ("a/b/deep.txt", b"deep"),
            ("zero", b""),
            ("ünïcødé/名前.txt", "unicode".as_bytes()),
            ("spaces in name", b"s"),
            ("bin/run.sh", b"#!/bin/sh\necho hi\n"),
            ("ro.txt", b"read only"),
        ],
    );
    // Two chunks and a bit, and exactly two chunks.
    fs::write(root.join("big.bin"), bytes(1, (2 * CHUNK + 123) as usize)).unwrap();
    fs::write(root.join("a/exact.bin"), bytes(2, (2 * CHUNK) as usize)).unwrap();
    fs::create_dir_all(root.join("empty/nested-empty")).unwrap();
    symlink("a/b/deep.txt", root.join("link-file")).unwrap();
    symlink("../../zero", root.join("a/b/link-up")).unwrap();
    symlink("a", root.join("link-dir")).unwrap();
    fs::set_permissions(root.join("bin/run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(root.join("ro.txt"), fs::Permissions::from_mode(0o444)).unwrap();
    fs::set_permissions(root.join("empty"), fs::Permissions::from_mode(0o700)).unwrap();
    filetime::set_file_mtime(
        root.join("a/b/deep.txt"),
        FileTime::from_unix_time(1_500_000_000, 123_456_789),
    )
    .unwrap();
    filetime::set_file_mtime(root.join("a"), FileTime::from_unix_time(1_400_000_000, 0)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tree_round_trip_keeps_everything() {
    let c = Cluster::start().await;
    let src = c.dir.path().join("src");
    rich_tree(&src);
    let client = c.client();
    let put = client
        .put(
            &key("team/rich"),
            &src,
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .unwrap();
    assert_eq!(put.stats.bytes_skipped, 0);
    let dest = c.dir.path().join("dest");
    let got = client
        .get(&key("team/rich"), &dest, Progress::none())
        .await
        .unwrap();
    assert_eq!(got.dest, dest);
    assert_eq!(
        fingerprint(&dest),
        fingerprint(&src),
        "the fetched tree differs from the source"
    );
    let rec = client.stat(&key("team/rich")).await.unwrap();
    assert!(rec.is_dir);
    assert_eq!(rec.files, fingerprint(&src).file_count());
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_file_round_trip() {
    let c = Cluster::start().await;
    let src = c.dir.path().join("weights.bin");
    fs::write(&src, bytes(3, (3 * CHUNK + 5) as usize)).unwrap();
    fs::set_permissions(&src, fs::Permissions::from_mode(0o640)).unwrap();
    let small = c.dir.path().join("config.json");
    fs::write(&small, b"{}").unwrap();
    let client = c.client();
    client
        .put(
            &key("m/weights"),
            &src,
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .unwrap();
    client
        .put(
            &key("m/config"),
            &small,
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .unwrap();
    assert!(!client.stat(&key("m/weights")).await.unwrap().is_dir);

    // --dest naming a new path: the file is written there.
    let out = c.dir.path().join("out/copy.bin");
    let got = client
        .get(&key("m/weights"), &out, Progress::none())
        .await
        .unwrap();
    assert_eq!(got.dest, out);
    assert_eq!(fs::read(&out).unwrap(), fs::read(&src).unwrap());
    let mut want = fingerprint(&src);
    want.entries[0].path = "copy.bin".into();
    assert_eq!(fingerprint(&out), want);

    // --dest naming an existing directory: the file lands inside under its own name.
    let dir = c.dir.path().join("into");
    fs::create_dir(&dir).unwrap();
    let got = client
        .get(&key("m/config"), &dir, Progress::none())
        .await
        .unwrap();
    assert_eq!(got.dest, dir.join("config.json"));
    assert_eq!(fs::read(dir.join("config.json")).unwrap(), b"{}");
    assert_eq!(fingerprint(&dir.join("config.json")).root, RootKind::File);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_put_and_get_move_only_changes() {
    let c = Cluster::start().await;
    let src = c.dir.path().join("src");
    let files: Vec<(String, Vec<u8>)> = (0..50)
        .map(|i| (format!("d{}/f{i}", i % 5), bytes(i, 1000 + i as usize)))
        .collect();
    let refs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(p, d)| (p.as_str(), d.as_slice()))
        .collect();
    write_files(&src, &refs);
    fs::write(src.join("large"), bytes(99, (4 * CHUNK) as usize)).unwrap();
    let client = c.client();
    let k = key("inc/tree");
    client
        .put(&k, &src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    let total = fingerprint(&src).total_bytes();
    assert_eq!(c.store_metrics.bytes_in(), total);

    // Unchanged: nothing moves.
    let noop = client
        .put(&k, &src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    assert!(noop.unchanged);
    assert_eq!(c.store_metrics.bytes_in(), total);

    // Change two files, add one, delete one, rename one (its content is already there).
    fs::write(src.join("d0/f0"), b"changed").unwrap();
    fs::write(src.join("d1/f1"), b"changed too").unwrap();
    fs::write(src.join("new"), b"brand new").unwrap();
    fs::remove_file(src.join("d2/f2")).unwrap();
    fs::rename(src.join("d3/f3"), src.join("d3/f3-renamed")).unwrap();
    let changed = client
        .put(&k, &src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    let moved = (b"changed".len() + b"changed too".len() + b"brand new".len()) as u64;
    assert_eq!(changed.stats.bytes_sent, moved);
    assert_eq!(
        c.store_metrics.bytes_in(),
        total + moved,
        "only changed content may move"
    );

    // The key's tree is exactly the new source tree (the deleted file is gone).
    let fresh = c.dir.path().join("fresh");
    client.get(&k, &fresh, Progress::none()).await.unwrap();
    assert_eq!(fingerprint(&fresh), fingerprint(&src));

    // An incremental get moves only what differs from the destination.
    let out_before = c.store_metrics.bytes_out();
    fs::write(src.join("d4/f4"), b"fourth change").unwrap();
    client
        .put(&k, &src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    let g = client.get(&k, &fresh, Progress::none()).await.unwrap();
    assert_eq!(g.stats.bytes_sent, b"fourth change".len() as u64);
    assert_eq!(
        c.store_metrics.bytes_out() - out_before,
        b"fourth change".len() as u64
    );
    assert_eq!(fingerprint(&fresh), fingerprint(&src));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ls_stat_and_recursive_rm() {
    let c = Cluster::start().await;
    let src = c.dir.path().join("f");
    fs::write(&src, b"x").unwrap();
    let client = c.client();
    for k in ["svc/a", "svc/a/b", "svc/c/d", "other"] {
        client
            .put(&key(k), &src, PutOptions::default(), Progress::none())
            .await
            .unwrap();
    }
    let root = client.ls(&kt_types::KeyPrefix::root()).await.unwrap();
    let names: Vec<_> = root.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["other", "svc"]);
    let svc = client
        .ls(&kt_types::KeyPrefix::parse("svc").unwrap())
        .await
        .unwrap();
    let a = &svc.entries[0];
    assert!(a.record.is_some() && a.has_children);
    assert!(svc.entries[1].record.is_none() && svc.entries[1].has_children);

    // Non-recursive delete of a prefix that is not a key is refused.
    let e = client.rm(&key("svc/c"), false).await.unwrap_err();
    assert_eq!(e.code(), Some(kt_types::ErrorCode::Conflict));
    let del = client.rm(&key("svc"), true).await.unwrap();
    assert_eq!(del.deleted.len(), 3);
    assert!(
        client
            .ls(&kt_types::KeyPrefix::parse("svc").unwrap())
            .await
            .unwrap()
            .entries
            .is_empty()
    );
    let e = client.stat(&key("svc/a")).await.unwrap_err();
    assert_eq!(e.code(), Some(kt_types::ErrorCode::NotFound));
    // The store no longer holds the data.
    let e = client
        .get(&key("svc/a"), &c.dir.path().join("x"), Progress::none())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(kt_types::ErrorCode::NotFound));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_expires_keys_and_their_data() {
    let c = Cluster::start().await;
    let src = c.dir.path().join("f");
    fs::write(&src, b"short-lived").unwrap();
    let client = c.client();
    let opts = PutOptions {
        ttl_secs: Some(1),
        ..Default::default()
    };
    client
        .put(&key("tmp/x"), &src, opts, Progress::none())
        .await
        .unwrap();
    assert!(
        client
            .stat(&key("tmp/x"))
            .await
            .unwrap()
            .expires_at_ms
            .is_some()
    );
    let store = c.store_url();
    kt_tests::wait_until(
        "expired key removed from the store",
        std::time::Duration::from_secs(15),
        || {
            let url = format!("{store}/api/v1/trees");
            async move {
                let r = kt_api::client()
                    .get(url)
                    .bearer_auth(kt_tests::TOKEN)
                    .send()
                    .await
                    .unwrap();
                let list: kt_types::api::TreeList = r.json().await.unwrap();
                list.keys.is_empty()
            }
        },
    )
    .await;
    assert!(client.stat(&key("tmp/x")).await.is_err());
    c.stop().await;
}
