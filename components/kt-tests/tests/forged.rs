//! Trust no peer: a peer source that serves something else than the
//! published version is caught before a byte of it is written, the get
//! completes from an honest source, and the peer never sees a bearer token.
//!
//! Servers on loopback with a tokens file: workloads of services `alpha`
//! and `beta` reading nothing else, an agent of beta's reading nothing
//! else, and a "compromised" agent that may read alpha (so it is a
//! legitimate peer of alpha's keys) and serves forged bytes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use kt_service::{Auth, Token};
use kt_types::api::{AgentHeartbeat, BatchRequest, HeartbeatReply, ReadHeader, Served};
use kt_types::auth::{AuthFile, Grant, Role};
use kt_types::{Key, Manifest};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const ADMIN: &str = "admin-token-0123456789";
const STORE: &str = "store-token-0123456789";
const ALPHA: &str = "workload-alpha-0123456";
const BETA: &str = "workload-beta-01234567";
/// Agent pod-b, of service beta, reading nothing else.
const BETA_AGENT: &str = "agent-token-pod-b-0123";
/// Agent pod-r, which may read alpha: a peer gone bad.
const ROGUE_AGENT: &str = "agent-token-pod-r-0123";

fn auth_file(dir: &std::path::Path) -> Auth {
    let grant =
        |token: &str, role, name: Option<&str>, services: Option<&str>, reads: &[&str]| Grant {
            token: token.into(),
            role,
            name: name.map(str::to_owned),
            services: services.map(|s| vec![s.to_owned()]),
            reads: services.map(|_| reads.iter().map(|s| s.to_string()).collect()),
        };
    let file = AuthFile {
        tokens: vec![
            grant(ADMIN, Role::Admin, None, None, &[]),
            grant(STORE, Role::Store, None, None, &[]),
            grant(ALPHA, Role::Workload, None, Some("alpha"), &[]),
            grant(BETA, Role::Workload, None, Some("beta"), &[]),
            grant(BETA_AGENT, Role::Agent, Some("pod-b"), Some("beta"), &[]),
            grant(
                ROGUE_AGENT,
                Role::Agent,
                Some("pod-r"),
                Some("beta"),
                &["alpha"],
            ),
        ],
    };
    let path = dir.join("auth.json");
    std::fs::write(&path, serde_json::to_vec(&file).unwrap()).unwrap();
    Auth::from_file(&path).unwrap()
}

/// A metadata server and a store, each with its own role's token.
struct Servers {
    meta: String,
    stop: CancellationToken,
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn start(dir: &std::path::Path) -> Servers {
    let auth = auth_file(dir);
    let stop = CancellationToken::new();
    let meta_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let meta = format!("http://{}", meta_l.local_addr().unwrap());
    let mut cfg = kt_metadata::Config::new(dir.join("meta"), Token::new(ADMIN).unwrap());
    cfg.server.auth = Some(auth.clone());
    let s = stop.clone();
    tokio::spawn(async move { kt_metadata::run(meta_l, cfg, s).await.unwrap() });
    let store_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut store =
        kt_store::Config::new(dir.join("store"), meta.clone(), Token::new(STORE).unwrap());
    store.server.auth = Some(auth);
    kt_store::start(store_l, store, stop.clone()).unwrap();
    let http = kt_api::client();
    kt_tests::wait_until("the store registered", Duration::from_secs(20), || {
        let r = http
            .get(format!("{meta}/api/v1/store"))
            .bearer_auth(ALPHA)
            .send();
        async move { r.await.is_ok_and(|r| r.status().is_success()) }
    })
    .await;
    Servers { meta, stop }
}

fn client(s: &Servers, dir: &std::path::Path, token: &str) -> kt_client::Client {
    let mut cfg = kt_client::ClientConfig::new(s.meta.clone(), token);
    cfg.cache_dir = Some(dir.join(format!("cache-{token}")));
    cfg.agent_socket = dir.join("no-agent.sock");
    cfg.serve_copies = false;
    cfg.deadline = Duration::from_secs(20);
    kt_client::Client::new(cfg).unwrap()
}

/// `src` put under `k` by `c`, into the store.
async fn put(c: &kt_client::Client, k: &str, src: &std::path::Path) -> kt_client::PutSummary {
    c.put(
        &key(k),
        src,
        Default::default(),
        kt_client::Progress::none(),
    )
    .await
    .unwrap()
}

/// The store's URL, as it registered.
async fn store_url(s: &Servers) -> String {
    kt_api::client()
        .get(format!("{}/api/v1/store", s.meta))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json::<kt_types::api::StoreLocation>()
        .await
        .unwrap()
        .url
}

fn key(k: &str) -> Key {
    Key::parse(k).unwrap()
}

/// What the forger serves.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Forgery {
    /// A manifest of its own making (other content, other hashes).
    Manifest,
    /// The genuine manifest (it may read the key), other bytes.
    Chunks,
}

/// A peer gone bad: answers the read protocol with forged data, and keeps
/// every `Authorization` header it is shown.
struct Forger {
    genuine: Vec<u8>,
    forgery: Forgery,
    seen: Mutex<Vec<String>>,
}

impl Forger {
    fn manifest(&self) -> Manifest {
        kt_types::api::ReadManifest::from_document(&self.genuine)
            .unwrap()
            .manifest
    }
}

async fn open(State(f): State<Arc<Forger>>, headers: HeaderMap) -> impl IntoResponse {
    let shown = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    f.seen.lock().unwrap().push(shown);
    let genuine = kt_types::api::ReadManifest::from_document(&f.genuine).unwrap();
    let mut manifest = genuine.manifest.clone();
    if f.forgery == Forgery::Manifest {
        for e in manifest.entries.iter_mut().filter(|e| e.hash.is_some()) {
            e.hash = Some(kt_types::Hash(*blake3::hash(b"forged").as_bytes()));
            e.size = 6;
        }
    }
    let header = ReadHeader {
        version: genuine.version,
        lease: "forged-lease".into(),
        chunk_size: genuine.chunk_size,
    };
    (
        [("content-type", kt_types::codec::DOCUMENT_CONTENT_TYPE)],
        kt_types::codec::encode_document(&header, &manifest),
    )
}

async fn batch(
    State(f): State<Arc<Forger>>,
    axum::Json(req): axum::Json<BatchRequest>,
) -> axum::body::Body {
    let m = f.manifest();
    let items = req
        .indices
        .iter()
        .map(|&i| {
            let e = &m.entries[i as usize];
            kt_sync::batch::SendItem {
                index: i,
                path: e.path.clone().into(),
                size: e.size,
                entry_path: e.path.clone(),
                data: Some(bytes::Bytes::from(vec![b'X'; e.size as usize])),
                beneath: None,
            }
        })
        .collect();
    axum::body::Body::from_stream(kt_sync::batch::send_stream(items, None))
}

async fn range(
    Path((_, _)): Path<(String, u32)>,
    axum::extract::Query(q): axum::extract::Query<kt_types::api::RangeQuery>,
) -> Vec<u8> {
    vec![b'X'; q.len as usize]
}

/// Serves `forger` on loopback; its base URL.
async fn serve(forger: Arc<Forger>, stop: &CancellationToken) -> String {
    use axum::routing::{delete, get, post};
    let app = axum::Router::new()
        .route("/api/v1/trees/{*key}", get(open))
        .route("/api/v1/reads/{lease}/batch", post(batch))
        .route("/api/v1/reads/{lease}/files/{index}", get(range))
        .route(
            "/api/v1/reads/{lease}",
            delete(|| async { axum::http::StatusCode::NO_CONTENT }),
        )
        .with_state(forger);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let stop = stop.clone();
    tokio::spawn(async move {
        axum::serve(l, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
            .unwrap()
    });
    url
}

async fn heartbeat(
    meta: &str,
    token: &str,
    id: &str,
    url: &str,
    serves: &[(&str, &str)],
) -> HeartbeatReply {
    let hb = AgentHeartbeat {
        id: id.into(),
        url: url.into(),
        service: Some("beta".into()),
        serves: serves
            .iter()
            .map(|(k, v)| Served {
                key: key(k),
                version: (*v).into(),
            })
            .collect(),
    };
    let resp = kt_api::client()
        .post(format!("{meta}/api/v1/agents"))
        .bearer_auth(token)
        .json(&hb)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    resp.json().await.unwrap()
}

async fn peers(meta: &str, k: &str) -> Vec<String> {
    let r: kt_types::KeyRecord = kt_api::client()
        .get(format!("{meta}/api/v1/keys/{k}"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    r.peers.into_iter().map(|p| p.id).collect()
}

/// alpha/model in the store, written by alpha: (its version, the tree).
async fn put_model(s: &Servers, dir: &std::path::Path) -> (String, std::path::PathBuf) {
    let src = dir.join("model");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("weights.bin"), vec![7u8; 300 << 10]).unwrap();
    std::fs::write(src.join("config.json"), b"{\"layers\": 2}").unwrap();
    let put = put(&client(s, dir, ALPHA), "alpha/model", &src).await;
    let record = put.record.expect("the store registered the put");
    assert!(
        record.digest.is_some(),
        "the record anchors the manifest's digest"
    );
    (record.version, src)
}

async fn forged_peer_is_caught(forgery: Forgery) {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let (version, src) = put_model(&s, dir.path()).await;
    let store = store_url(&s).await;
    let genuine = kt_api::client()
        .get(format!("{store}/api/v1/trees/alpha/model"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    let forger = Arc::new(Forger {
        genuine,
        forgery,
        seen: Mutex::default(),
    });
    let url = serve(forger.clone(), &s.stop).await;
    // pod-r may read alpha: the metadata server takes it as a peer.
    let reply = heartbeat(
        &s.meta,
        ROGUE_AGENT,
        "pod-r",
        &url,
        &[("alpha/model", &version)],
    )
    .await;
    assert!(reply.drop.is_empty(), "{:?}", reply.drop);
    assert!(
        !reply.capability_keys.is_empty(),
        "agents are given the keys capabilities are signed with"
    );
    assert_eq!(peers(&s.meta, "alpha/model").await, ["pod-r"]);

    // Idle peers are offered before the origin: alpha's get goes to pod-r
    // first, refuses what it serves, and completes from the store.
    let dest = dir.path().join("got");
    client(&s, dir.path(), ALPHA)
        .get(&key("alpha/model"), &dest, kt_client::Progress::none())
        .await
        .unwrap();
    for f in ["weights.bin", "config.json"] {
        assert_eq!(
            std::fs::read(dest.join(f)).unwrap(),
            std::fs::read(src.join(f)).unwrap(),
            "{f}: the genuine bytes"
        );
    }
    let seen = forger.seen.lock().unwrap().clone();
    assert!(!seen.is_empty(), "the get tried the forger");
    for shown in &seen {
        assert!(
            shown.starts_with("Bearer kt-cap."),
            "the forger saw {shown:?}"
        );
        assert!(!shown.contains(ALPHA));
    }
    // A permanent failure: the forger is no longer offered for the key.
    assert!(peers(&s.meta, "alpha/model").await.is_empty());

    // The capability it was shown reads nothing anywhere else: the
    // metadata server and the store do not take it.
    let cap = seen[0].strip_prefix("Bearer ").unwrap().to_owned();
    for url in [
        format!("{}/api/v1/keys/alpha/model", s.meta),
        format!("{store}/api/v1/trees/alpha/model"),
    ] {
        let status = kt_api::client()
            .get(&url)
            .bearer_auth(&cap)
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, 401, "{url}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_manifest_is_refused_and_the_get_completes_from_the_store() {
    forged_peer_is_caught(Forgery::Manifest).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_chunks_are_refused_and_the_get_completes_from_the_store() {
    forged_peer_is_caught(Forgery::Chunks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_serves_only_what_its_token_reads_and_only_getters_report_their_leases() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let (version, _) = put_model(&s, dir.path()).await;
    // F1a: beta's agent (reading nothing but beta) claims alpha's key.
    let reply = heartbeat(
        &s.meta,
        BETA_AGENT,
        "pod-b",
        "http://127.0.0.1:9",
        &[("alpha/model", &version)],
    )
    .await;
    assert_eq!(reply.drop, [key("alpha/model")]);
    assert!(peers(&s.meta, "alpha/model").await.is_empty());

    // F7: a lease's failure is reported by its getter only.
    let http = kt_api::client();
    let lease: kt_types::api::SourceLease = http
        .post(format!("{}/api/v1/keys/alpha/model/lease", s.meta))
        .bearer_auth(ALPHA)
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(lease.source.id, "store");
    assert_eq!(
        lease.capability, None,
        "the store is shown the getter's token"
    );
    let report = serde_json::json!({ "reason": "x\ny", "transient": false });
    let failed = |token: &'static str| {
        http.post(format!("{}/api/v1/leases/{}/failed", s.meta, lease.lease))
            .bearer_auth(token)
            .json(&report)
            .send()
    };
    assert_eq!(failed(BETA).await.unwrap().status(), 403);
    assert_eq!(failed(ALPHA).await.unwrap().status(), 204);
    // Without a lease, a report naming a key and source drops nothing.
    heartbeat(
        &s.meta,
        ROGUE_AGENT,
        "pod-r",
        "http://127.0.0.1:9",
        &[("alpha/model", &version)],
    )
    .await;
    let orphan = serde_json::json!({
        "reason": "x", "transient": false, "key": "alpha/model", "source": "pod-r"
    });
    let status = http
        .post(format!("{}/api/v1/leases/gone/failed", s.meta))
        .bearer_auth(BETA)
        .json(&orphan)
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 204);
    assert_eq!(peers(&s.meta, "alpha/model").await, ["pod-r"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setuid_and_setgid_bits_never_travel() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let src = dir.path().join("tool");
    std::fs::write(&src, b"#!/bin/sh\necho hi\n").unwrap();
    std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o6755)).unwrap();
    let alpha = client(&s, dir.path(), ALPHA);
    put(&alpha, "alpha/tool", &src).await;
    let dest = dir.path().join("got-tool");
    alpha
        .get(&key("alpha/tool"), &dest, kt_client::Progress::none())
        .await
        .unwrap();
    let mode = std::fs::metadata(&dest).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o755, "{mode:o}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_planned_before_another_service_took_the_key_is_not_committed() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let store = store_url(&s).await;
    let http = kt_api::client();
    // beta plans shared/race (absent, and under no service's base path,
    // so its own service may have it) and uploads its file, but does not
    // commit yet.
    let data = b"beta's bytes".to_vec();
    let manifest = Manifest {
        root: kt_types::RootKind::Dir,
        entries: vec![kt_types::Entry {
            path: "f".into(),
            kind: kt_types::EntryKind::File,
            size: data.len() as u64,
            mode: 0o644,
            mtime: 0,
            mtime_nsec: 0,
            hash: Some(kt_types::Hash(*blake3::hash(&data).as_bytes())),
            target: None,
        }],
    };
    let encoded = kt_types::codec::to_bytes(&manifest);
    let doc = kt_types::codec::document_with(
        &serde_json::json!({ "key": "shared/race", "digest": kt_sync::digest_of_encoded(&encoded) }),
        &encoded,
    );
    let plan: kt_types::api::PutPlan = http
        .post(format!("{}/api/v1/puts", store))
        .bearer_auth(BETA)
        .body(doc)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let session = plan.session.expect("an upload session");
    assert_eq!(plan.needed, [0]);
    let item = kt_sync::batch::SendItem {
        index: 0,
        path: "f".into(),
        size: data.len() as u64,
        entry_path: "f".into(),
        data: Some(bytes::Bytes::from(data)),
        beneath: None,
    };
    let frames: Vec<bytes::Bytes> =
        futures::TryStreamExt::try_collect(kt_sync::batch::send_stream(vec![item], None))
            .await
            .unwrap();
    let sent = http
        .put(format!("{}/api/v1/puts/{session}/batch", store))
        .bearer_auth(BETA)
        .body(frames.concat())
        .send()
        .await
        .unwrap();
    assert!(sent.status().is_success(), "{}", sent.status());

    // Meanwhile alpha puts the key, which becomes alpha's.
    let src = dir.path().join("alpha.txt");
    std::fs::write(&src, b"alpha's bytes").unwrap();
    let alpha = client(&s, dir.path(), ALPHA);
    put(&alpha, "shared/race", &src).await;

    // beta's commit comes too late: refused, and alpha's key is as alpha put it.
    let commit = http
        .post(format!("{}/api/v1/puts/{session}/commit", store))
        .bearer_auth(BETA)
        .send()
        .await
        .unwrap();
    assert_eq!(commit.status(), 403);
    let body: kt_types::ErrorBody = commit.json().await.unwrap();
    assert!(
        body.error.message.contains("alpha"),
        "{}",
        body.error.message
    );
    let got = dir.path().join("got.txt");
    alpha
        .get(&key("shared/race"), &got, kt_client::Progress::none())
        .await
        .unwrap();
    assert_eq!(std::fs::read(&got).unwrap(), b"alpha's bytes");
}

/// A 403 whose message names `what`.
async fn refused_naming(r: reqwest::Response, what: &str) {
    assert_eq!(r.status(), 403);
    let body: kt_types::ErrorBody = r.json().await.unwrap();
    assert!(body.error.message.contains(what), "{}", body.error.message);
}

/// Review B4: a heartbeat naming a service makes it known, and a known
/// service owns the keys under its name; an agent of beta announcing
/// "alpha" would have taken alpha's prefix from alpha's own writers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_announces_only_a_service_its_token_writes() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let hb = |service: &str| AgentHeartbeat {
        id: "pod-b".into(),
        url: "http://127.0.0.1:1".into(),
        service: Some(service.into()),
        serves: Vec::new(),
    };
    let http = kt_api::client();
    let announce = |service: &str| {
        http.post(format!("{}/api/v1/agents", s.meta))
            .bearer_auth(BETA_AGENT)
            .json(&hb(service))
            .send()
    };
    refused_naming(announce("alpha").await.unwrap(), "alpha").await;
    // Its own service is announced as ever.
    let r = announce("beta").await.unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    // alpha's writer still writes its own prefix.
    let src = dir.path().join("a.txt");
    std::fs::write(&src, b"alpha").unwrap();
    put(&client(&s, dir.path(), ALPHA), "alpha/own", &src).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_putter_must_write_the_keys_service() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let join = |agent: &str, k: &str| {
        serde_json::json!({
            "agent": agent, "ip": "127.0.0.1", "endpoint": "127.0.0.1:1", "backend": "host",
            "role": "put", "keys": [{ "key": k, "version": "v", "tensors": [] }],
            "window": { "world_size": 2, "fanout": 2 }
        })
    };
    let http = kt_api::client();
    let call = |token: &'static str, body: serde_json::Value| {
        http.post(format!("{}/api/v1/quorums/q/join", s.meta))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    // beta's agent as the putter of alpha's key: refused before it takes a rank.
    let r = call(BETA_AGENT, join("pod-b", "alpha/model/w"))
        .await
        .unwrap();
    refused_naming(r, "alpha").await;
    let info = http
        .get(format!("{}/api/v1/quorums/q", s.meta))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(info.status(), 404, "no round was opened");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_is_a_final_clear_answer() {
    // Everything the data volume has is kept in reserve: no put fits.
    let c = kt_tests::Cluster::start_with(|cfg| cfg.reserve = Some(u64::MAX / 4)).await;
    let src = c.dir.path().join("w.bin");
    std::fs::write(&src, vec![5u8; 10 << 10]).unwrap();
    let before = kt_tests::listing(&c.store_data());
    let put = tokio::time::timeout(
        Duration::from_secs(60),
        c.client().put(
            &key("ml/w"),
            &src,
            Default::default(),
            kt_client::Progress::none(),
        ),
    )
    .await
    .expect("refused at once, not retried to the deadline");
    let e = put.expect_err("the store is full");
    assert_eq!(
        e.code(),
        Some(kt_types::ErrorCode::InsufficientStorage),
        "{e}"
    );
    let msg = e.to_string();
    assert!(msg.contains("store full: this put needs"), "{msg}");
    assert!(msg.contains("is free"), "{msg}");
    // Nothing staged is left behind, nothing registered.
    assert_eq!(kt_tests::listing(&c.store_data()), before);
    assert!(c.client().stat(&key("ml/w")).await.is_err());
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_is_not_told_who_a_workloads_token_is() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let http = kt_api::client();
    let review = |asker: &'static str, token: &'static str| {
        let r = http
            .post(format!("{}/api/v1/auth/review", s.meta))
            .bearer_auth(asker)
            .json(&serde_json::json!({ "token": token }))
            .send();
        async move {
            let r = r.await.unwrap();
            assert_eq!(r.status(), 200);
            r.json::<kt_types::auth::TokenAnswer>().await.unwrap()
        }
    };
    // The store is shown workloads' tokens: it is told.
    let a = review(STORE, ALPHA).await;
    assert_eq!(a.principal.map(|p| p.role), Some(Role::Workload));
    // An agent is shown agents' tokens (tensor sessions), not workloads'.
    let a = review(BETA_AGENT, ROGUE_AGENT).await;
    assert_eq!(a.principal.map(|p| p.role), Some(Role::Agent));
    for token in [ALPHA, STORE] {
        let a = review(BETA_AGENT, token).await;
        assert_eq!(a.principal, None, "{token}");
        assert!(a.reason.is_some());
    }
}
