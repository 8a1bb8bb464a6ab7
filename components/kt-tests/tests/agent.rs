//! The node agent with the real metadata server and store, in-process: its
//! control socket, local and copy exports served over the read protocol,
//! confinement to what was exported, heartbeats, and restarts.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::time::Duration;

use kt_client::Progress;
use kt_tests::{
    Agent, CHUNK, Cluster, ControlClient, TOKEN, bytes, fetch, fingerprint, open_read, read_range,
    wait_until, write_files,
};
use kt_types::agent::{CONTROL_VERSION, ControlReply, ControlRequest, ExportInfo};
use kt_types::api::{AgentList, PutOptions};
use kt_types::{ErrorCode, Key, KeyRecord, Locale, Manifest};

const WAIT: Duration = Duration::from_secs(20);

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

/// Small files, nested directories, an in-tree link and a file of two chunks and a bit.
fn tree(root: &Path) {
    write_files(
        root,
        &[("a/b/deep.txt", b"deep"), ("zero", b""), ("c/d.txt", b"d")],
    );
    fs::write(root.join("big.bin"), bytes(7, (2 * CHUNK + 99) as usize)).unwrap();
    symlink("a/b/deep.txt", root.join("link")).unwrap();
}

async fn export_local(agent: &Agent, k: &str, path: &Path) -> ControlReply {
    agent
        .control()
        .await
        .ask(&ControlRequest::ExportLocal {
            key: key(k),
            path: path.display().to_string(),
            options: PutOptions::default(),
        })
        .await
        .expect("a reply")
}

async fn export_copy(
    agent: &Agent,
    k: &str,
    version: &str,
    path: &Path,
    m: Manifest,
) -> ControlReply {
    agent
        .control()
        .await
        .ask(&ControlRequest::ExportCopy {
            key: key(k),
            version: version.into(),
            path: path.display().to_string(),
            manifest: m,
        })
        .await
        .expect("a reply")
}

async fn status(agent: &Agent) -> Vec<ExportInfo> {
    match agent.control().await.ask(&ControlRequest::Status).await {
        Some(ControlReply::Status { exports, .. }) => exports,
        other => panic!("{other:?}"),
    }
}

async fn stat(c: &Cluster, k: &str) -> Option<KeyRecord> {
    c.client().stat(&key(k)).await.ok()
}

fn error_code(r: &ControlReply) -> Option<ErrorCode> {
    match r {
        ControlReply::Error { code, .. } => Some(*code),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_socket_says_hello_and_refuses_other_versions() {
    let c = Cluster::start().await;
    let agent = c.start_agent("pod-hello").await;
    let mut s = ControlClient::connect(agent.socket()).await.unwrap();
    let hello = s
        .ask(&ControlRequest::Hello {
            version: CONTROL_VERSION,
            keepalive: false,
        })
        .await;
    assert_eq!(
        hello,
        Some(ControlReply::Hello {
            version: CONTROL_VERSION,
            agent: "pod-hello".into(),
            url: agent.url.clone(),
            keepalive: false,
            shm_dir: Some(c.shm_dir().canonicalize().unwrap().display().to_string()),
        })
    );
    let st = s.ask(&ControlRequest::Status).await;
    assert!(
        matches!(&st, Some(ControlReply::Status { agent: a, exports, .. }) if a == "pod-hello" && exports.is_empty()),
        "{st:?}"
    );

    let mut s = ControlClient::connect(agent.socket()).await.unwrap();
    let reply = s
        .ask(&ControlRequest::Hello {
            version: CONTROL_VERSION + 1,
            keepalive: false,
        })
        .await
        .unwrap();
    match reply {
        ControlReply::Error { code, message } => {
            assert_eq!(code, ErrorCode::InvalidRequest);
            assert!(message.contains("version"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // The connection is closed after a refused hello.
    assert!(s.ask(&ControlRequest::Status).await.is_none());
    agent.stop().await;
    c.stop().await;
}

/// A metadata server restarting (a rollout, a crash) answers 503
/// `unavailable` through its proxy for a while: a local put waits for it,
/// trying again with backoff, and registers once it is back, instead of
/// failing the put (the chaos soak's `local-put` failures during metadata
/// restarts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_put_waits_for_a_restarting_metadata_server() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let mut c = Cluster::start().await;
    let agent = c.start_agent("pod-patient").await;
    let src = c.dir.path().join("src");
    tree(&src);
    let addr = c.stop_metadata().await;
    let tries = Arc::new(AtomicUsize::new(0));
    let outage = {
        let tries = tries.clone();
        let app = axum::Router::new().fallback(move || {
            tries.fetch_add(1, Ordering::SeqCst);
            async {
                (
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    // As a proxy's answer for a pod that is gone: the
                    // next try opens a new connection.
                    [(axum::http::header::CONNECTION, "close")],
                    axum::Json(kt_types::ErrorBody::new(
                        ErrorCode::Unavailable,
                        "the metadata server is restarting",
                    )),
                )
            }
        });
        let l = tokio::net::TcpListener::bind(addr).await.unwrap();
        tokio::spawn(async move { axum::serve(l, app).await })
    };
    let put = {
        let agent_socket = agent.socket().to_owned();
        let src = src.clone();
        tokio::spawn(async move {
            ControlClient::open(&agent_socket)
                .await
                .ask(&ControlRequest::ExportLocal {
                    key: key("team/patient"),
                    path: src.display().to_string(),
                    options: PutOptions::default(),
                })
                .await
                .expect("a reply")
        })
    };
    wait_until("the agent trying the metadata server again", WAIT, || {
        let tries = tries.clone();
        async move { tries.load(Ordering::SeqCst) >= 2 }
    })
    .await;
    assert!(
        !put.is_finished(),
        "the put gave up on a restarting metadata server"
    );
    outage.abort();
    let _ = outage.await;
    c.start_metadata(addr).await;
    let reply = put.await.unwrap();
    let ControlReply::Exported { record, .. } = reply else {
        panic!("the put failed: {reply:?}")
    };
    let record = record.expect("a local put answers its record");
    assert_eq!(record_of(&c, "team/patient").await.version, record.version);
    agent.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_export_registers_a_local_key_and_serves_it() {
    let c = Cluster::start().await;
    let agent = c.start_agent("pod-producer").await;
    let src = c.dir.path().join("src");
    tree(&src);

    let reply = export_local(&agent, "team/local", &src).await;
    let ControlReply::Exported { export, record } = reply else {
        panic!("{reply:?}")
    };
    assert!(export.origin);
    assert_eq!(export.files, fingerprint(&src).file_count());
    let record = record.expect("a local put answers its record");
    assert_eq!(record.version, export.version);

    // The metadata server knows the key as local, held by this agent.
    let rec = record_of(&c, "team/local").await;
    assert_eq!(rec.locale, Locale::Local);
    assert_eq!(rec.holder, "pod-producer");
    assert_eq!(rec.source, agent.url);
    assert_eq!(rec.version, export.version);
    assert!(rec.is_dir);

    // The agent serves the files in place, over the store's read protocol.
    let http = kt_api::client();
    let dest = c.dir.path().join("dest");
    let read = fetch(&http, &agent.url, "team/local", &dest).await.unwrap();
    assert_eq!(read.version, export.version);
    assert_eq!(fingerprint(&dest), fingerprint(&src));
    // Nothing was copied: the agent's state holds records, not data.
    let state_bytes: u64 = kt_sync::du::disk_bytes(&agent.config.state_dir);
    assert!(state_bytes < 2 * CHUNK, "{state_bytes} bytes of state");

    // A single file, served under whatever name it has.
    let file = c.dir.path().join("weights.bin");
    fs::write(&file, bytes(9, 5000)).unwrap();
    let reply = export_local(&agent, "team/file", &file).await;
    assert!(matches!(reply, ControlReply::Exported { .. }), "{reply:?}");
    assert!(!record_of(&c, "team/file").await.is_dir);
    let got = c.dir.path().join("got.bin");
    fetch(&http, &agent.url, "team/file", &got).await.unwrap();
    assert_eq!(fs::read(&got).unwrap(), fs::read(&file).unwrap());

    // An unchanged tree exports the same version again.
    let again = export_local(&agent, "team/local", &src).await;
    assert!(
        matches!(&again, ControlReply::Exported { export: e, .. } if e.version == export.version),
        "{again:?}"
    );

    // Relative and missing paths are refused, nothing registered.
    let r = export_local(&agent, "team/rel", Path::new("relative/dir")).await;
    assert_eq!(error_code(&r), Some(ErrorCode::InvalidRequest), "{r:?}");
    let r = export_local(&agent, "team/gone", &c.dir.path().join("missing")).await;
    assert_eq!(error_code(&r), Some(ErrorCode::NotFound), "{r:?}");
    assert!(stat(&c, "team/rel").await.is_none());

    // The agent is listed by the metadata server under its URL.
    let agents: AgentList = kt_api::client()
        .get(format!("{}/api/v1/agents", c.metadata_url()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        agents
            .agents
            .iter()
            .any(|a| a.id == "pod-producer" && a.url == agent.url),
        "{agents:?}"
    );
    agent.stop().await;
    c.stop().await;
}

/// The chaos soak (seed 97147130): a get in the origin's pod that leased
/// an older version ended just after the pod put the key again; its copy
/// took the origin export's place, the next heartbeat dropped it as stale,
/// and the key's registered origin served nothing (getters: `no_source`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_another_version_never_replaces_the_pods_origin_export() {
    let c = Cluster::start().await;
    let agent = c.start_agent("pod-origin").await;
    let src = c.dir.path().join("src");
    tree(&src);
    let reply = export_local(&agent, "team/local", &src).await;
    let ControlReply::Exported { export, .. } = reply else {
        panic!("{reply:?}")
    };
    let older = c.dir.path().join("older");
    write_files(&older, &[("x", b"old")]);
    let m = fingerprint(&older);
    let r = export_copy(&agent, "team/local", "an-older-version", &older, m).await;
    assert_eq!(error_code(&r), Some(ErrorCode::Conflict), "{r:?}");
    // The origin export stays, registered and served.
    let st = status(&agent).await;
    assert!(
        st.len() == 1 && st[0].origin && st[0].version == export.version,
        "{st:?}"
    );
    let rec = record_of(&c, "team/local").await;
    assert_eq!(
        (rec.holder.as_str(), rec.version.as_str()),
        ("pod-origin", export.version.as_str())
    );
    let dest = c.dir.path().join("dest");
    let read = fetch(&kt_api::client(), &agent.url, "team/local", &dest)
        .await
        .unwrap();
    assert_eq!(read.version, export.version);
    assert_eq!(fingerprint(&dest), fingerprint(&src));
    // A copy of the origin's own version is taken as the origin export.
    let same = export_copy(&agent, "team/local", &export.version, &dest, read.manifest).await;
    assert!(
        matches!(&same, ControlReply::Exported { export: e, .. } if e.origin),
        "{same:?}"
    );
    agent.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_export_serves_a_download_and_heartbeats_announce_it() {
    let c = Cluster::start().await;
    let src = c.dir.path().join("src");
    tree(&src);
    put(&c, "team/shared", &src).await;
    // A getter downloads from the store, then offers its copy.
    let http = kt_api::client();
    let copy = c.dir.path().join("copy");
    let read = fetch(&http, &c.store_url(), "team/shared", &copy)
        .await
        .unwrap();
    let agent = c.start_agent("pod-getter").await;
    let reply = export_copy(
        &agent,
        "team/shared",
        &read.version,
        &copy,
        read.manifest.clone(),
    )
    .await;
    let ControlReply::Exported { export, record } = reply else {
        panic!("{reply:?}")
    };
    assert!(!export.origin);
    assert!(record.is_none());

    let dest = c.dir.path().join("dest");
    let again = fetch(&http, &agent.url, "team/shared", &dest)
        .await
        .unwrap();
    assert_eq!(again.version, read.version);
    assert_eq!(fingerprint(&dest), fingerprint(&src));

    // Its heartbeat carries what it serves: the key's record lists it as a peer.
    wait_until("the agent listed as a peer", WAIT, || async {
        stat(&c, "team/shared").await.is_some_and(|r| {
            r.peers
                .iter()
                .any(|p| p.id == "pod-getter" && p.url == agent.url && p.version == read.version)
        })
    })
    .await;

    // A copy of another version than the current one is dropped on the next beat.
    let stale = c.dir.path().join("stale");
    write_files(&stale, &[("x", b"old")]);
    let m = fingerprint(&stale);
    let reply = export_copy(&agent, "team/shared", "not-current", &stale, m).await;
    assert!(matches!(reply, ControlReply::Exported { .. }), "{reply:?}");
    wait_until("the stale copy dropped", WAIT, || async {
        status(&agent).await.is_empty()
    })
    .await;
    agent.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_outside_the_exports_is_served() {
    let c = Cluster::start().await;
    let agent = c.start_agent("pod-guard").await;
    let http = kt_api::client();
    let outside = c.dir.path().join("outside");
    write_files(
        &outside,
        &[("secret.txt", b"TOP SECRET"), ("d/f.txt", b"SECRET TOO")],
    );

    // A copy export serves its manifest's entries only, not other files there.
    let copy = c.dir.path().join("copy");
    write_files(
        &copy,
        &[("d/f.txt", b"public"), ("keep.txt", b"public too")],
    );
    let manifest = fingerprint(&copy);
    // (The key exists at this version, or the next heartbeat would drop the copy.)
    let version = put(&c, "team/copy", &copy).await;
    write_files(&copy, &[("private.txt", b"not exported")]);
    let reply = export_copy(&agent, "team/copy", &version, &copy, manifest.clone()).await;
    assert!(matches!(reply, ControlReply::Exported { .. }), "{reply:?}");
    let read = open_read(&http, &agent.url, "team/copy").await.unwrap();
    assert_eq!(read.manifest, manifest);
    assert!(
        read.manifest
            .entries
            .iter()
            .all(|e| e.path != "private.txt")
    );
    // Indices beyond the manifest, and entries that are not files, are refused.
    let past = read.manifest.entries.len() as u32;
    let dir_index = read
        .manifest
        .entries
        .iter()
        .position(|e| e.path == "d")
        .unwrap() as u32;
    for index in [past, dir_index] {
        let err = read_range(&http, &agent.url, &read.lease, index, 0, 1)
            .await
            .unwrap_err();
        assert_eq!(
            (err.status, err.code),
            (400, Some(ErrorCode::InvalidRequest))
        );
    }

    // A directory of the export swapped for a link to elsewhere: refused, not followed.
    let f_index = read
        .manifest
        .entries
        .iter()
        .position(|e| e.path == "d/f.txt")
        .unwrap() as u32;
    fs::remove_dir_all(copy.join("d")).unwrap();
    symlink(outside.join("d"), copy.join("d")).unwrap();
    let err = read_range(&http, &agent.url, &read.lease, f_index, 0, 4)
        .await
        .unwrap_err();
    assert_eq!(err.code, Some(ErrorCode::Conflict), "{err:?}");
    let batch = http
        .post(format!("{}/api/v1/reads/{}/batch", agent.url, read.lease))
        .bearer_auth(TOKEN)
        .json(&kt_types::api::BatchRequest {
            indices: vec![f_index],
        })
        .send()
        .await
        .unwrap();
    assert_eq!(batch.status().as_u16(), 409);
    assert!(!batch.text().await.unwrap().contains("SECRET"));
    // A file of the export replaced by a link to a secret: refused too.
    let keep_index = read
        .manifest
        .entries
        .iter()
        .position(|e| e.path == "keep.txt")
        .unwrap() as u32;
    fs::remove_file(copy.join("keep.txt")).unwrap();
    symlink(outside.join("secret.txt"), copy.join("keep.txt")).unwrap();
    let err = read_range(&http, &agent.url, &read.lease, keep_index, 0, 4)
        .await
        .unwrap_err();
    assert_eq!(err.code, Some(ErrorCode::Conflict), "{err:?}");
    // A FIFO in its place (nobody writes it): refused at once, not waited
    // on by a thread of the agent.
    fs::remove_file(copy.join("keep.txt")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        copy.join("keep.txt"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let within = std::time::Duration::from_secs(10);
    let err = tokio::time::timeout(
        within,
        read_range(&http, &agent.url, &read.lease, keep_index, 0, 4),
    )
    .await
    .expect("a FIFO held the read")
    .unwrap_err();
    assert_eq!(err.code, Some(ErrorCode::Conflict), "{err:?}");
    assert!(err.message.contains("regular file"), "{err:?}");

    // Keys it does not export are not found; there is no way to write.
    let err = open_read(&http, &agent.url, "team/other")
        .await
        .unwrap_err();
    assert_eq!((err.status, err.code), (404, Some(ErrorCode::NotFound)));
    for (method, path) in [
        ("POST", "/api/v1/puts"),
        ("PUT", "/api/v1/puts/s/batch"),
        ("DELETE", "/api/v1/trees/team/copy"),
        ("GET", "/api/v1/trees"),
    ] {
        let resp = http
            .request(
                reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
                format!("{}{path}", agent.url),
            )
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert!(
            [404, 405].contains(&resp.status().as_u16()),
            "{method} {path}: {}",
            resp.status()
        );
    }
    // Every API but health needs the token.
    let resp = http
        .get(format!("{}/api/v1/trees/team/copy", agent.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    for health in ["/healthz", "/readyz"] {
        let resp = http
            .get(format!("{}{health}", agent.url))
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{health}");
    }
    // A copy whose path is not what its manifest says is refused.
    let r = export_copy(&agent, "team/bad", "v1", &copy.join("d/f.txt"), manifest).await;
    assert_eq!(error_code(&r), Some(ErrorCode::InvalidRequest), "{r:?}");
    // So is one whose files are not what its manifest says: the agent looks
    // at the disk rather than trust the client.
    let other = c.dir.path().join("other");
    write_files(&other, &[("a.txt", b"12345"), ("b/c.txt", b"x")]);
    let described = fingerprint(&other);
    fs::write(other.join("a.txt"), b"123456789").unwrap();
    let r = export_copy(&agent, "team/bad", "v1", &other, described.clone()).await;
    let ControlReply::Error { message, .. } = &r else {
        panic!("exported a copy whose file grew: {r:?}");
    };
    assert!(
        message.contains("a file of 5 bytes, the disk has a file of 9"),
        "{r:?}"
    );
    fs::remove_file(other.join("a.txt")).unwrap();
    symlink("b/c.txt", other.join("a.txt")).unwrap();
    let r = export_copy(&agent, "team/bad", "v1", &other, described).await;
    assert_eq!(error_code(&r), Some(ErrorCode::InvalidRequest), "{r:?}");
    assert_eq!(status(&agent).await.len(), 1);
    agent.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_keys_are_dropped_by_the_next_heartbeat() {
    let c = Cluster::start().await;
    let agent = c.start_agent("pod-rm").await;
    let src = c.dir.path().join("src");
    tree(&src);
    let reply = export_local(&agent, "team/temp", &src).await;
    assert!(matches!(reply, ControlReply::Exported { .. }), "{reply:?}");
    c.client().rm(&key("team/temp"), false).await.unwrap();
    wait_until("the export dropped", WAIT, || async {
        status(&agent).await.is_empty()
    })
    .await;
    // The user's files are untouched.
    assert_eq!(fingerprint(&src).file_count(), 4);
    let err = open_read(&kt_api::client(), &agent.url, "team/temp")
        .await
        .unwrap_err();
    assert_eq!(err.status, 404);
    agent.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_survive_an_agent_restart() {
    let c = Cluster::start().await;
    let mut agent = c.start_agent("pod-restart").await;
    let src = c.dir.path().join("src");
    tree(&src);
    let reply = export_local(&agent, "team/kept", &src).await;
    assert!(matches!(reply, ControlReply::Exported { .. }), "{reply:?}");
    let file = c.dir.path().join("one.bin");
    fs::write(&file, b"single").unwrap();
    let version = put(&c, "team/one", &file).await;
    let m = fingerprint(&file);
    let reply = export_copy(&agent, "team/one", &version, &file, m).await;
    assert!(matches!(reply, ControlReply::Exported { .. }), "{reply:?}");
    let before = status(&agent).await;
    assert_eq!(before.len(), 2);

    agent.restart().await;
    assert_eq!(status(&agent).await, before);
    let http = kt_api::client();
    let dest = c.dir.path().join("dest");
    fetch(&http, &agent.url, "team/kept", &dest).await.unwrap();
    assert_eq!(fingerprint(&dest), fingerprint(&src));
    let got = c.dir.path().join("got.bin");
    fetch(&http, &agent.url, "team/one", &got).await.unwrap();
    assert_eq!(fs::read(&got).unwrap(), b"single");
    // Still the key's holder, announced again by the restarted agent.
    let rec = record_of(&c, "team/kept").await;
    assert_eq!(
        (rec.holder.as_str(), rec.source.as_str()),
        ("pod-restart", agent.url.as_str())
    );
    agent.stop().await;
    c.stop().await;
}

/// Puts `src` in the store under `k`; returns the version.
async fn put(c: &Cluster, k: &str, src: &Path) -> String {
    c.client()
        .put(&key(k), src, PutOptions::default(), Progress::none())
        .await
        .unwrap();
    record_of(c, k).await.version
}

async fn record_of(c: &Cluster, k: &str) -> KeyRecord {
    stat(c, k)
        .await
        .unwrap_or_else(|| panic!("no record of {k}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_key_whose_file_changed_size_fails_at_once_and_clearly() {
    let c = Cluster::start().await;
    let agent = c.start_agent("pod-producer").await;
    let file = c.dir.path().join("weights.bin");
    fs::write(&file, bytes(3, 5000)).unwrap();
    let reply = export_local(&agent, "team/grown", &file).await;
    assert!(matches!(reply, ControlReply::Exported { .. }), "{reply:?}");
    // The producer writes on after the zero-copy put.
    fs::write(&file, bytes(3, 6000)).unwrap();
    // A permanent answer, not a transient one retried to the deadline.
    let got = tokio::time::timeout(
        Duration::from_secs(60),
        c.client().get(
            &key("team/grown"),
            &c.dir.path().join("got.bin"),
            Progress::none(),
        ),
    )
    .await
    .expect("the get fails well before its deadline");
    let e = got.expect_err("the changed file is refused").to_string();
    assert!(e.contains("changed since the put"), "{e}");
    assert!(e.contains("6000 bytes now, 5000 when it was put"), "{e}");
    agent.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_exports_neither_system_files_nor_its_own_state_nor_outside_its_roots() {
    use std::os::unix::fs::PermissionsExt;
    let c = Cluster::start().await;
    let data = c.dir.path().join("data");
    tree(&data.join("model"));
    let elsewhere = c.dir.path().join("elsewhere");
    tree(&elsewhere);
    let agent = c
        .start_agent_with("pod-roots", |cfg| cfg.export_roots = vec![data.clone()])
        .await;
    let state = agent.config.state_dir.clone();
    for (path, why) in [
        (Path::new("/etc/passwd"), "never serves"),
        (state.as_path(), "never serves"),
        (elsewhere.as_path(), "outside this agent's export roots"),
    ] {
        for reply in [
            export_local(&agent, "team/x", path).await,
            export_copy(&agent, "team/x", "v1", path, fingerprint(&data)).await,
        ] {
            let ControlReply::Error { code, message } = &reply else {
                panic!("{}: {reply:?}", path.display())
            };
            assert_eq!(*code, ErrorCode::Forbidden, "{message}");
            assert!(message.contains(why), "{message}");
        }
    }
    assert!(stat(&c, "team/x").await.is_none(), "nothing registered");
    // Below a root: served. The state is the agent's alone.
    let reply = export_local(&agent, "team/model", &data.join("model")).await;
    assert!(matches!(reply, ControlReply::Exported { .. }), "{reply:?}");
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&state), 0o700);
    for sub in ["exports", "cache"] {
        assert_eq!(mode(&state.join(sub)), 0o700, "{sub}");
    }
    for f in fs::read_dir(state.join("exports")).unwrap() {
        assert_eq!(mode(&f.unwrap().path()), 0o600);
    }
    agent.stop().await;
    c.stop().await;
}
