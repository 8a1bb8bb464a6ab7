//! A store that is down for a while (restarting, rescheduled) fails no
//! transfer that can wait for it: gets and puts back off and finish once it
//! answers again, within their deadline; past it they fail saying which
//! source failed, how, and for how long they waited.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kt_client::Progress;
use kt_tests::{Cluster, bytes, fingerprint, wait_until, write_files};
use kt_types::api::PutOptions;
use kt_types::{ErrorCode, Key};
use tokio::net::TcpListener;

/// Stands in for a store that is restarting: takes its address, accepts
/// connections and closes them at once (what a client sees while a pod's
/// process is down behind its Service), and counts them.
struct Outage {
    tries: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Outage {
    async fn at(addr: SocketAddr) -> Outage {
        let l = TcpListener::bind(addr)
            .await
            .expect("bind the store's address");
        let tries = Arc::new(AtomicUsize::new(0));
        let n = tries.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = l.accept().await {
                n.fetch_add(1, Ordering::SeqCst);
                drop(conn);
            }
        });
        Outage { tries, task }
    }

    /// Waits until clients tried at least `n` times (so they did back off
    /// and come again rather than give up).
    async fn wait_tries(&self, n: usize) {
        let tries = self.tries.clone();
        wait_until(
            "clients retrying the store",
            Duration::from_secs(20),
            || {
                let tries = tries.clone();
                async move { tries.load(Ordering::SeqCst) >= n }
            },
        )
        .await;
    }

    /// Ends the outage: the address is free for the store again.
    async fn end(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_waits_for_the_store_and_finishes_when_it_is_back() {
    let mut c = Cluster::start().await;
    let src = c.dir.path().join("src");
    write_files(&src, &[("a", b"alpha"), ("big", &bytes(7, 600_000))]);
    let client = c.client();
    let k = Key::parse("outage/get").unwrap();
    client
        .put(&k, &src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    let addr = c.stop_store().await;
    let outage = Outage::at(addr).await;
    let dest = c.dir.path().join("dest");
    let get = {
        let (client, k, dest) = (client.clone(), k.clone(), dest.clone());
        tokio::spawn(async move { client.get(&k, &dest, Progress::none()).await })
    };
    outage.wait_tries(3).await;
    assert!(!get.is_finished(), "the get gave up on a restarting store");
    outage.end().await;
    c.start_store(addr).await;
    get.await
        .unwrap()
        .expect("the get finishes once the store is back");
    assert_eq!(fingerprint(&dest), fingerprint(&src));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_waits_for_the_store_and_publishes_once() {
    let mut c = Cluster::start().await;
    let src = c.dir.path().join("src");
    write_files(&src, &[("old", b"v1")]);
    let client = c.client();
    let k = Key::parse("outage/put").unwrap();
    client
        .put(&k, &src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    let v1 = client.stat(&k).await.unwrap().version;
    write_files(&src, &[("new", &bytes(8, 300_000))]);
    let addr = c.stop_store().await;
    let outage = Outage::at(addr).await;
    let put = {
        let (client, k, src) = (client.clone(), k.clone(), src.clone());
        tokio::spawn(async move {
            client
                .put(&k, &src, PutOptions::default(), Progress::none())
                .await
        })
    };
    outage.wait_tries(3).await;
    assert!(!put.is_finished(), "the put gave up on a restarting store");
    // Meanwhile the old version is still the key's.
    assert_eq!(client.stat(&k).await.unwrap().version, v1);
    outage.end().await;
    c.start_store(addr).await;
    let s = put
        .await
        .unwrap()
        .expect("the put finishes once the store is back");
    let v2 = s.record.expect("published").version;
    assert_ne!(v2, v1);
    let dest = c.dir.path().join("dest");
    client.get(&k, &dest, Progress::none()).await.unwrap();
    assert_eq!(fingerprint(&dest), fingerprint(&src));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_deadline_a_get_says_what_failed_and_how_long_it_waited() {
    let mut c = Cluster::start().await;
    let src = c.dir.path().join("f");
    std::fs::write(&src, b"data").unwrap();
    let k = Key::parse("outage/deadline").unwrap();
    c.client()
        .put(&k, &src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    c.stop_store().await;
    let client = c.client_with(|cfg| cfg.deadline = Duration::from_millis(800));
    let e = client
        .get(&k, &c.dir.path().join("dest"), Progress::none())
        .await
        .unwrap_err();
    let msg = e.to_string();
    assert_eq!(e.code(), Some(ErrorCode::NoSource), "{msg}");
    assert!(msg.contains("no progress for"), "{msg}");
    assert!(msg.contains("store: "), "{msg}");
    assert!(msg.contains("transient"), "{msg}");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_cut_off_by_a_store_restart_sends_only_the_rest() {
    let mut c = Cluster::start().await;
    let src = c.dir.path().join("src");
    let size = 16 << 20;
    write_files(&src, &[("big", &bytes(11, size)), ("small", b"small")]);
    let k = Key::parse("outage/resume").unwrap();
    // A rolling update halfway: stopped (TERM) and started again on its address.
    let put = c.put_cut_by_store_restart(&k, &src, size / 2).await;
    let summary = put.await.unwrap().unwrap();
    assert!(!summary.unchanged);
    // The restarted store took the rest, not the whole file again.
    let again = c.store_metrics.bytes_in() as usize;
    assert!(
        again <= size / 2 + (2 << 20),
        "the restarted store received {again} bytes of a {size}-byte file"
    );
    assert!(
        summary.stats.bytes_sent as usize <= size / 2 + (2 << 20),
        "{:?}",
        summary.stats
    );
    let dest = c.dir.path().join("dest");
    c.client().get(&k, &dest, Progress::none()).await.unwrap();
    assert_eq!(fingerprint(&dest), fingerprint(&src));
    c.stop().await;
}
