//! Restarting either server loses no key and no data.

use std::fs;

use kt_client::Progress;
use kt_tests::{Cluster, bytes, fingerprint, write_files};
use kt_types::api::PutOptions;
use kt_types::{Key, KeyPrefix, Lifespan};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_lose_nothing() {
    let mut c = Cluster::start().await;
    let src = c.dir.path().join("src");
    write_files(&src, &[("a", b"alpha"), ("dir/b", &bytes(5, 300_000))]);
    let client = c.client();
    let k = Key::parse("keep/tree").unwrap();
    let opts = PutOptions {
        lifespan: Some(Lifespan::Resource),
        ttl_secs: Some(3600),
        service: Some("trainer".into()),
    };
    client.put(&k, &src, opts, Progress::none()).await.unwrap();
    let before = client.stat(&k).await.unwrap();

    c.restart_metadata().await;
    c.restart_store().await;
    let after = client.stat(&k).await.unwrap();
    assert_eq!(
        after, before,
        "the metadata record must survive restarts unchanged"
    );
    let listing = client.ls(&KeyPrefix::parse("keep").unwrap()).await.unwrap();
    assert_eq!(listing.entries.len(), 1);
    let dest = c.dir.path().join("dest");
    client.get(&k, &dest, Progress::none()).await.unwrap();
    assert_eq!(fingerprint(&dest), fingerprint(&src));

    // Both restarted at once, then an incremental put still diffs against the kept version.
    c.restart_store().await;
    fs::write(src.join("a"), b"ALPHA").unwrap();
    let s = client
        .put(&k, &src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    assert_eq!(s.stats.bytes_sent, 5);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_reregisters_keys_the_metadata_server_lost() {
    let mut c = Cluster::start().await;
    let src = c.dir.path().join("f");
    fs::write(&src, b"data").unwrap();
    let client = c.client();
    let k = Key::parse("lost/key").unwrap();
    client
        .put(&k, &src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    // Lose the metadata server's whole registry: the store is the source of truth for its data.
    c.restart_metadata_wiped().await;
    assert!(client.stat(&k).await.is_err());
    c.restart_store().await;
    assert_eq!(client.stat(&k).await.unwrap().key, k);
    c.stop().await;
}
