//! Prefix gets (every key below a prefix, each into its own directory) and
//! mirror gets (the destination becomes exactly the key's tree), with the
//! real servers and client.

use std::fs;

use kt_client::{GetOptions, Progress};
use kt_tests::{Cluster, listing, write_files};
use kt_types::api::PutOptions;
use kt_types::{ErrorCode, Key, KeyPrefix};

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prefix_get_fetches_every_key_below_into_its_own_place() {
    let c = Cluster::start().await;
    let client = c.client();
    for (k, body) in [
        ("run/train/shard-0", "zero"),
        ("run/train/shard-1", "one"),
        ("run/train/deep/shard-2", "two"),
        ("run/eval/other", "not below train/"),
        ("run/trainer", "a sibling, not below train/"),
    ] {
        let src = c.dir.path().join(format!("src-{}", k.replace('/', "-")));
        write_files(&src, &[("data.txt", body.as_bytes())]);
        client
            .put(&key(k), &src, PutOptions::default(), Progress::none())
            .await
            .unwrap();
    }
    let dest = c.dir.path().join("dest");
    let got = client
        .get_prefix(
            &KeyPrefix::parse("run/train").unwrap(),
            &dest,
            &GetOptions::default(),
        )
        .await
        .unwrap();
    let keys: Vec<String> = got.gets.iter().map(|(k, _)| k.to_string()).collect();
    assert_eq!(
        keys,
        [
            "run/train/deep/shard-2",
            "run/train/shard-0",
            "run/train/shard-1"
        ]
    );
    assert!(got.skipped.is_empty());
    assert_eq!(
        listing(&dest),
        [
            "deep",
            "deep/shard-2",
            "deep/shard-2/data.txt",
            "shard-0",
            "shard-0/data.txt",
            "shard-1",
            "shard-1/data.txt"
        ]
    );
    assert_eq!(
        fs::read_to_string(dest.join("deep/shard-2/data.txt")).unwrap(),
        "two"
    );
    let none = client
        .get_prefix(
            &KeyPrefix::parse("run/nothing").unwrap(),
            &c.dir.path().join("none"),
            &GetOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(none.code(), Some(ErrorCode::NotFound), "{none}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mirror_get_removes_what_the_key_does_not_have_and_a_plain_one_does_not() {
    let c = Cluster::start().await;
    let client = c.client();
    let src = c.dir.path().join("src");
    write_files(
        &src,
        &[
            ("keep.txt", b"k"),
            ("old/gone.txt", b"g"),
            ("dir/a.txt", b"a"),
        ],
    );
    client
        .put(
            &key("m/data"),
            &src,
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .unwrap();
    let (plain, mirror) = (c.dir.path().join("plain"), c.dir.path().join("mirror"));
    for d in [&plain, &mirror] {
        client
            .get(&key("m/data"), d, Progress::none())
            .await
            .unwrap();
    }
    // The key loses a file and a directory.
    fs::remove_dir_all(src.join("old")).unwrap();
    fs::remove_file(src.join("dir/a.txt")).unwrap();
    fs::write(src.join("dir/b.txt"), b"b").unwrap();
    client
        .put(
            &key("m/data"),
            &src,
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .unwrap();
    // A local file the key never had, in both copies.
    for d in [&plain, &mirror] {
        fs::write(d.join("mine.txt"), b"local").unwrap();
    }
    client
        .get(&key("m/data"), &plain, Progress::none())
        .await
        .unwrap();
    client
        .get_with(
            &key("m/data"),
            &mirror,
            &GetOptions { delete: true },
            Progress::none(),
        )
        .await
        .unwrap();
    assert_eq!(
        listing(&plain),
        [
            "dir",
            "dir/a.txt",
            "dir/b.txt",
            "keep.txt",
            "mine.txt",
            "old",
            "old/gone.txt"
        ],
        "additive by default"
    );
    assert_eq!(listing(&mirror), ["dir", "dir/b.txt", "keep.txt"]);
    assert_eq!(listing(&mirror), listing(&src));
}
