//! Readers see the old tree or the new one; a killed put leaves the old one.

use std::fs;
use std::path::Path;
use std::time::Duration;

use kt_client::Progress;
use kt_tests::{CHUNK, Cluster, bytes, fingerprint, listing, wait_until};
use kt_types::api::PutOptions;
use kt_types::{Key, Manifest};

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

/// A tree where every file's content is tagged with `tag`.
fn tagged_tree(root: &Path, tag: u8, files: usize, large: usize) {
    for i in 0..files {
        let p = root.join(format!("d{}/f{i}", i % 7));
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, vec![tag; 100 + i]).unwrap();
    }
    for i in 0..large {
        let mut data = bytes(i as u64, (3 * CHUNK) as usize);
        data[0] = tag;
        fs::write(root.join(format!("large{i}")), data).unwrap();
    }
}

fn is_one_of(got: &Manifest, a: &Manifest, b: &Manifest) -> bool {
    // Compare content only (mtimes of the destination's directories are set by the get).
    let strip = |m: &Manifest| -> Vec<(String, Option<kt_types::Hash>)> {
        m.entries.iter().map(|e| (e.path.clone(), e.hash)).collect()
    };
    strip(got) == strip(a) || strip(got) == strip(b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_puts_and_gets_never_see_a_mix() {
    let c = Cluster::start().await;
    let (a, b) = (c.dir.path().join("a"), c.dir.path().join("b"));
    tagged_tree(&a, b'A', 60, 1);
    tagged_tree(&b, b'B', 60, 1);
    let (fa, fb) = (fingerprint(&a), fingerprint(&b));
    let k = key("race/tree");
    let client = c.client();
    client
        .put(&k, &a, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    for round in 0..4 {
        let (c1, c2, c3) = (c.client(), c.client(), c.client());
        let (k1, k2, k3) = (k.clone(), k.clone(), k.clone());
        let (pa, pb) = (a.clone(), b.clone());
        let dest = c.dir.path().join(format!("get-{round}"));
        let d2 = dest.clone();
        let put_a = tokio::spawn(async move {
            c1.put(&k1, &pa, PutOptions::default(), Progress::none())
                .await
        });
        let put_b = tokio::spawn(async move {
            c2.put(&k2, &pb, PutOptions::default(), Progress::none())
                .await
        });
        let get = tokio::spawn(async move { c3.get(&k3, &d2, Progress::none()).await });
        put_a.await.unwrap().unwrap();
        put_b.await.unwrap().unwrap();
        get.await.unwrap().unwrap();
        assert!(
            is_one_of(&fingerprint(&dest), &fa, &fb),
            "a get during puts saw a mixed tree"
        );
        let after = c.dir.path().join(format!("after-{round}"));
        client.get(&k, &after, Progress::none()).await.unwrap();
        assert!(
            is_one_of(&fingerprint(&after), &fa, &fb),
            "concurrent puts produced a mixed tree"
        );
    }
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_put_leaves_the_old_version_and_restart_cleans_up() {
    // Interrupted uploads are kept this long for resuming.
    let mut c = Cluster::start_with(|cfg| cfg.session_ttl = Duration::from_secs(3)).await;
    let (old, new) = (c.dir.path().join("old"), c.dir.path().join("new"));
    tagged_tree(&old, b'O', 20, 0);
    // Large enough that the put is still running when it is killed.
    tagged_tree(&new, b'N', 20, 150);
    let k = key("kill/tree");
    let client = c.client();
    client
        .put(&k, &old, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    let before = c.store_metrics.bytes_in();

    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kt-test-node"))
        .args(["put", &c.metadata_url(), k.as_str(), new.to_str().unwrap()])
        .spawn()
        .unwrap();
    let metrics = c.store_metrics.clone();
    wait_until(
        "the put to start moving data",
        Duration::from_secs(20),
        || {
            let m = metrics.clone();
            async move { m.bytes_in() > before }
        },
    )
    .await;
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the put finished before it could be killed; the test proves nothing"
    );

    let dest = c.dir.path().join("dest");
    client.get(&k, &dest, Progress::none()).await.unwrap();
    let strip = |m: Manifest| {
        m.entries
            .into_iter()
            .map(|e| (e.path, e.hash))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        strip(fingerprint(&dest)),
        strip(fingerprint(&old)),
        "the old version must be intact"
    );

    // The staging area of the killed put is kept across a restart for a
    // while (the same put would resume from it), then removed.
    let key_dir = c
        .store_data()
        .join("keys")
        .join(blake3::hash(k.as_str().as_bytes()).to_hex().as_str());
    let versions = |dir: &Path| {
        listing(dir)
            .into_iter()
            .filter(|p| p.starts_with("v-") && !p.contains('/') && !p.contains('.'))
            .count()
    };
    c.restart_store().await;
    wait_until(
        "the interrupted upload's staging removed",
        Duration::from_secs(30),
        || {
            let key_dir = key_dir.clone();
            async move {
                versions(&key_dir) == 1
                    && !listing(&key_dir)
                        .iter()
                        .any(|p| p.ends_with(".put") || p.ends_with(".chunks"))
            }
        },
    )
    .await;
    let dest2 = c.dir.path().join("dest2");
    client.get(&k, &dest2, Progress::none()).await.unwrap();
    assert_eq!(strip(fingerprint(&dest2)), strip(fingerprint(&old)));
    c.stop().await;
}
