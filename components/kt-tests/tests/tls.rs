//! Transport security: the metadata server and the store serve HTTPS with
//! a certificate of a test CA, every kt client (the store's and the
//! metadata server's calls, the client library, broadcast WebSockets and
//! relays) trusts that CA through `KT_CA_FILE` and nothing else, and a
//! renewed certificate is served without a restart.
//!
//! One test in this binary: it sets `KT_CA_FILE`, `KT_TLS_CERT` and
//! `KT_TLS_KEY` before any thread exists (the relay and every kt client
//! read them from the environment, as in a pod).
#![allow(unsafe_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use kt_service::Token;
use kt_service::tls::Tls;
use kt_tests::certs::{Ca, ca, issue};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "tls-test-token";

#[test]
fn servers_and_clients_speak_tls_and_renewals_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let ca = ca();
    let ca_file = dir.path().join("ca.crt");
    std::fs::write(&ca_file, ca.cert.pem()).unwrap();
    let (cert, key, _) = issue(&ca, dir.path(), "server");
    // A CA the system's store would offer (rustls-native-certs reads
    // SSL_CERT_FILE): kt must not trust it, KT_CA_FILE does not name it.
    let system_ca = kt_tests::certs::ca();
    let system_file = dir.path().join("system.crt");
    std::fs::write(&system_file, system_ca.cert.pem()).unwrap();
    // SAFETY: no other thread exists yet (the runtime is built below), so
    // nothing reads the environment while it changes.
    unsafe {
        std::env::set_var(kt_types::env::CA_FILE, &ca_file);
        std::env::set_var(kt_types::env::TLS_CERT, &cert);
        std::env::set_var(kt_types::env::TLS_KEY, &key);
        std::env::set_var("SSL_CERT_FILE", &system_file);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(dir.path(), &ca, cert, key));
    rt.block_on(only_kt_ca_file(dir.path(), &system_ca));
}

/// A server whose certificate comes from a CA the system's store holds
/// (SSL_CERT_FILE) but KT_CA_FILE does not: every kt client refuses it,
/// whatever roots reqwest's features would load (review C1).
async fn only_kt_ca_file(dir: &Path, system_ca: &Ca) {
    let (cert, key, _) = issue(system_ca, dir, "system-signed");
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}/healthz", l.local_addr().unwrap());
    let mut meta = kt_metadata::Config::new(dir.join("meta-system"), Token::new(TOKEN).unwrap());
    meta.server.tls = Some(Tls::load(&cert, &key).unwrap());
    let stop = CancellationToken::new();
    let task = tokio::spawn(kt_metadata::run(l, meta, stop.clone()));
    // The server answers a client that trusts its CA...
    let trusting = kt_api::client_builder()
        .use_rustls_tls()
        .add_root_certificate(
            reqwest::Certificate::from_pem(system_ca.cert.pem().as_bytes()).unwrap(),
        )
        .build()
        .unwrap();
    kt_tests::wait_until(
        "the server answers over https",
        Duration::from_secs(20),
        || {
            let (trusting, url) = (trusting.clone(), url.clone());
            async move {
                trusting
                    .get(url)
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success())
            }
        },
    )
    .await;
    // ...and kt's client refuses its certificate (both test CAs have one
    // name: rustls finds KT_CA_FILE's and the signature does not match).
    let kt = kt_api::tls::http_builder().unwrap().build().unwrap();
    let refused = kt.get(&url).send().await;
    let e = refused.expect_err("kt trusted a CA that KT_CA_FILE does not name");
    let mut chain = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        chain = format!("{chain}: {s}");
        source = s.source();
    }
    assert!(chain.contains("invalid peer certificate"), "{chain}");
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
}

async fn run(dir: &Path, ca: &Ca, cert: PathBuf, key: PathBuf) {
    let stop = CancellationToken::new();
    // The metadata server looks for a renewal on every handshake.
    let meta_tls = Tls::reloading(&cert, &key, Duration::ZERO).unwrap();
    let meta_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let meta_url = format!("https://{}", meta_l.local_addr().unwrap());
    let mut meta = kt_metadata::Config::new(dir.join("meta"), Token::new(TOKEN).unwrap());
    meta.server.tls = Some(meta_tls);
    let s = stop.clone();
    let meta_task = tokio::spawn(async move { kt_metadata::run(meta_l, meta, s).await });
    let store_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut store = kt_store::Config::new(
        dir.join("store"),
        meta_url.clone(),
        Token::new(TOKEN).unwrap(),
    );
    store.server.tls = Some(Tls::load(&cert, &key).unwrap());
    let store = kt_store::start(store_l, store, stop.clone()).unwrap();

    // The store registered over https, and advertises https.
    let client = |name: &str| {
        let mut cfg = kt_client::ClientConfig::new(meta_url.clone(), TOKEN);
        cfg.cache_dir = Some(dir.join(format!("cache-{name}")));
        cfg.agent_socket = dir.join("no-agent.sock");
        kt_client::Client::new(cfg).unwrap()
    };
    let c = client("a");
    kt_tests::wait_until("the store registers", Duration::from_secs(20), || {
        let c = c.clone();
        async move { c.store_url().await.is_ok() }
    })
    .await;
    assert!(c.store_url().await.unwrap().starts_with("https://"));

    // A put and a get through the store, all over TLS.
    let src = dir.join("src");
    kt_tests::write_files(
        &src,
        &[("a.bin", &kt_tests::bytes(1, 300_000)), ("b/c.txt", b"c")],
    );
    let k = kt_types::Key::parse("tls/tree").unwrap();
    c.put(&k, &src, Default::default(), kt_client::Progress::none())
        .await
        .expect("put over https");
    let dest = dir.join("dest");
    c.get(&k, &dest, kt_client::Progress::none())
        .await
        .expect("get over https");
    assert_eq!(kt_tests::fingerprint(&dest), kt_tests::fingerprint(&src));

    // A broadcast: members join over wss, the child reads its parent's
    // relay over https (the relay serves KT_TLS_CERT). On a busy machine
    // the first member can finish, and be released, before the second
    // joins, which then reads from the store: a new group is tried until
    // one member read its parent's relay (what this test is about).
    let mut shapes = Vec::new();
    for attempt in 0..5 {
        let getters = ["g1", "g2"].map(|name| {
            let c = client(name);
            let dest = dir.join(format!("bc-{attempt}-{name}"));
            let k = k.clone();
            async move {
                let options = kt_client::broadcast::BroadcastOptions {
                    group: Some(format!("tls-{attempt}")),
                    fanout: Some(1),
                    window: Some(Duration::from_secs(30)),
                    delete: false,
                };
                let s = c
                    .get_broadcast(&k, &dest, &options, kt_client::Progress::none())
                    .await
                    .expect("broadcast over TLS");
                (dest, s)
            }
        });
        let mut chained = true;
        let mut shape = Vec::new();
        for (dest, s) in futures::future::join_all(getters).await {
            assert_eq!(kt_tests::fingerprint(&dest), kt_tests::fingerprint(&src));
            chained &= s.parents == vec![s.rank - 1];
            shape.push((s.rank, s.parents.clone()));
        }
        shapes.push(shape);
        if chained {
            break;
        }
    }
    let last = shapes.last().expect("one attempt");
    assert!(
        last.iter()
            .all(|(rank, parents)| *parents == vec![rank - 1]),
        "no broadcast read a relay over TLS: (rank, parents) per attempt {shapes:?}"
    );

    // Without the CA, or in plain http, nothing is answered.
    let bare = kt_api::client_builder().use_rustls_tls().build().unwrap();
    let refused = bare.get(format!("{meta_url}/healthz")).send().await;
    assert!(refused.is_err(), "an unknown CA is refused");
    let plain = meta_url.replacen("https://", "http://", 1);
    let plain = kt_api::client()
        .get(format!("{plain}/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.map(|r| !r.status().is_success()).unwrap_or(true));

    // A renewal (a new key and certificate in the same files) is served on
    // the next connection.
    let peer_cert = || async {
        let http = kt_api::tls::http_builder()
            .unwrap()
            .tls_info(true)
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        let r = http
            .get(format!("{meta_url}/healthz"))
            .send()
            .await
            .unwrap();
        r.extensions()
            .get::<reqwest::tls::TlsInfo>()
            .and_then(|i| i.peer_certificate().map(<[u8]>::to_vec))
            .unwrap()
    };
    let before = peer_cert().await;
    let renewed = dir.join("renewed");
    std::fs::create_dir_all(&renewed).unwrap();
    let (c2, k2, der) = issue(ca, &renewed, "server");
    // Renamed into place, as a volume update is: never half-written.
    std::fs::rename(&k2, &key).unwrap();
    std::fs::rename(&c2, &cert).unwrap();
    // A file's mtime can equal the first one's on a coarse clock: wait on
    // the condition, not a time.
    kt_tests::wait_until(
        "the renewed certificate is served",
        Duration::from_secs(10),
        || async {
            filetime::set_file_mtime(&cert, filetime::FileTime::now()).unwrap();
            peer_cert().await == der
        },
    )
    .await;
    assert_ne!(before, der);

    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), store.task).await;
    let _ = tokio::time::timeout(Duration::from_secs(15), meta_task).await;
}
