//! Puts of one tree that race each other after a store restart cut an
//! upload of it off: the staging version the restart kept is resumed by
//! one of them only (`kt_store::keys::Claim`), so no upload writes into a
//! version another published, and every get meanwhile receives the tree
//! whole (the chaos run's violation: "content does not match its hash",
//! the store its only source). The store-level interleaving itself is
//! reproduced deterministically in `kt_store::put`'s tests; this runs the
//! whole path with real servers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kt_client::Progress;
use kt_tests::{Cluster, bytes, fingerprint, write_files};
use kt_types::api::PutOptions;
use kt_types::{ErrorCode, Key};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn puts_racing_for_a_resumed_upload_never_serve_half_written_data() {
    let mut c = Cluster::start().await;
    let src = c.dir.path().join("src");
    let size = 4 << 20;
    write_files(&src, &[("large-0.bin", &bytes(46, size)), ("small", b"s")]);
    let want = fingerprint(&src);
    let k = Key::parse("chaos/s2").unwrap();

    // An upload cut off by a restart, halfway.
    let first = c.put_cut_by_store_restart(&k, &src, size / 2).await;

    // The same tree put again from several places at once, while getters
    // read the key.
    let puts: Vec<_> = (0..6)
        .map(|_| {
            let (client, k, src) = (c.client(), k.clone(), src.clone());
            tokio::spawn(async move {
                client
                    .put(&k, &src, PutOptions::default(), Progress::none())
                    .await
            })
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let getters: Vec<_> = (0..3)
        .map(|g| {
            let (client, k, want, stop) = (c.client(), k.clone(), want.clone(), stop.clone());
            let root = c.dir.path().join(format!("get-{g}"));
            tokio::spawn(async move {
                let mut got = 0;
                for n in 0.. {
                    if stop.load(Ordering::SeqCst) && got > 0 {
                        break;
                    }
                    let dest = root.join(n.to_string());
                    match client.get(&k, &dest, Progress::none()).await {
                        Ok(_) => {
                            assert_eq!(fingerprint(&dest), want, "get {n} of getter {g}");
                            got += 1;
                        }
                        // Not published yet.
                        Err(e) if e.code() == Some(ErrorCode::NotFound) => {}
                        Err(e) => panic!("get {n} of getter {g}: {e}"),
                    }
                }
            })
        })
        .collect();

    first.await.unwrap().expect("the interrupted put finishes");
    for p in puts {
        p.await.unwrap().expect("a racing put finishes");
    }
    stop.store(true, Ordering::SeqCst);
    for g in getters {
        g.await.unwrap();
    }
    let dest = c.dir.path().join("dest");
    c.client().get(&k, &dest, Progress::none()).await.unwrap();
    assert_eq!(fingerprint(&dest), want);
    c.stop().await;
}
