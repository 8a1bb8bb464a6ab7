//! Every wait bounded and explained: a metadata server that is stopped or
//! never answers fails calls fast, naming it; a call's own timeout names
//! the phase it ran out in; a missing key with keys below it says so. And
//! the agent sets itself up: it names its shared-memory directory, and one
//! told to exit when idle ends with its last client.

use std::time::Duration;

use kt_client::tensor::{HostTensor, Lend};
use kt_client::{Client, ClientConfig, Progress};
use kt_tests::{Cluster, ControlClient, TOKEN, wait_until, write_files};
use kt_types::agent::{CONTROL_VERSION, ControlReply, ControlRequest};
use kt_types::api::PutOptions;
use kt_types::tensor::{DType, MemHandle};
use kt_types::{ErrorCode, Key, KeyPrefix};

const WAIT: Duration = Duration::from_secs(30);

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

/// A URL nothing listens on: a port bound, then let go.
fn refusing_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    url
}

/// A server that accepts connections and never answers (a frozen metadata
/// server); it lives as long as the returned task.
async fn silent_url() -> (String, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((c, _)) = l.accept().await {
            held.push(c);
        }
    });
    (url, task)
}

/// A proxy whose metadata server is away: every request answered 503
/// `unavailable`.
async fn away_url() -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let task = tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            tokio::spawn(async move {
                let body = r#"{"error":{"code":"unavailable","message":"upstream is away"}}"#;
                let mut buf = vec![0u8; 64 << 10];
                // One answer per request read; the connection closes after.
                if c.read(&mut buf).await.unwrap_or(0) > 0 {
                    let resp = format!(
                        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = c.write_all(resp.as_bytes()).await;
                }
            });
        }
    });
    (url, task)
}

fn client(url: &str, dir: &std::path::Path, tune: impl FnOnce(&mut ClientConfig)) -> Client {
    let mut cfg = ClientConfig::new(url, TOKEN);
    cfg.cache_dir = None;
    cfg.agent_socket = dir.join("no-agent.sock");
    tune(&mut cfg);
    Client::new(cfg).unwrap()
}

fn names_the_server(e: &kt_client::ClientError, url: &str) {
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("cannot reach the metadata server at {url}")),
        "{msg}"
    );
    assert!(msg.contains("connecting to the metadata server"), "{msg}");
    assert!(msg.contains(kt_types::env::CONNECT_TIMEOUT), "{msg}");
    assert_eq!(e.code(), Some(ErrorCode::Unavailable), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_metadata_server_fails_every_call_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = refusing_url();
    // The defaults: what `kt get` and Python's `kt.get` run with.
    let c = client(&url, dir.path(), |_| {});
    let e = c
        .get(&key("svc/k"), &dir.path().join("out"), Progress::none())
        .await
        .unwrap_err();
    names_the_server(&e, &url);
    assert!(e.to_string().contains("refused"), "the cause: {e}");
    // Every other call too (a short connect timeout keeps the test short).
    let c = client(&url, dir.path(), |cfg| {
        cfg.connect_timeout = Duration::from_millis(200)
    });
    write_files(dir.path(), &[("src/f", b"data")]);
    let src = dir.path().join("src");
    let e = c
        .put(&key("svc/k"), &src, PutOptions::default(), Progress::none())
        .await
        .unwrap_err();
    names_the_server(&e, &url);
    // A zero-copy put, before any agent is started for it.
    let e = c
        .put_local(&key("svc/k"), &src, PutOptions::default())
        .await
        .unwrap_err();
    names_the_server(&e, &url);
    names_the_server(&c.ls(&KeyPrefix::root()).await.unwrap_err(), &url);
    names_the_server(&c.rm(&key("svc/k"), true).await.unwrap_err(), &url);
    names_the_server(&c.stat(&key("svc/k")).await.unwrap_err(), &url);
    let e = c
        .get_broadcast(
            &key("svc/k"),
            &dir.path().join("out"),
            &Default::default(),
            Progress::none(),
        )
        .await
        .unwrap_err();
    names_the_server(&e, &url);
    let e = c
        .get_prefix(
            &KeyPrefix::parse("svc").unwrap(),
            dir.path(),
            &Default::default(),
        )
        .await
        .unwrap_err();
    names_the_server(&e, &url);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metadata_server_that_never_answers_fails_calls_by_the_stall_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let (url, _server) = silent_url().await;
    let c = client(&url, dir.path(), |cfg| {
        cfg.connect_timeout = Duration::from_millis(100);
        cfg.stall = Duration::from_millis(300);
    });
    let e = c
        .get(&key("svc/k"), &dir.path().join("out"), Progress::none())
        .await
        .unwrap_err();
    names_the_server(&e, &url);
    assert!(e.to_string().contains("timed out"), "{e}");
    names_the_server(&c.ls(&KeyPrefix::root()).await.unwrap_err(), &url);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_saying_the_metadata_server_is_away_fails_calls_fast() {
    let dir = tempfile::tempdir().unwrap();
    let (url, _server) = away_url().await;
    let c = client(&url, dir.path(), |cfg| {
        cfg.connect_timeout = Duration::from_millis(200)
    });
    let e = c
        .get(&key("svc/k"), &dir.path().join("out"), Progress::none())
        .await
        .unwrap_err();
    names_the_server(&e, &url);
    assert!(e.to_string().contains("upstream is away"), "{e}");
    write_files(dir.path(), &[("src/f", b"data")]);
    let e = c
        .put(
            &key("svc/k"),
            &dir.path().join("src"),
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .unwrap_err();
    names_the_server(&e, &url);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calls_own_timeout_names_the_phase_it_ran_out_in() {
    let dir = tempfile::tempdir().unwrap();
    let (url, _server) = silent_url().await;
    // Nothing else would end these calls for a minute.
    let c = client(&url, dir.path(), |cfg| {
        cfg.connect_timeout = Duration::from_secs(60);
        cfg.stall = Duration::from_secs(60);
    });
    let quick = c.with_timeout(Some(Duration::from_millis(200)));
    assert_eq!(
        quick.config().call_timeout,
        Some(Duration::from_millis(200))
    );
    assert_eq!(
        c.config().call_timeout,
        None,
        "the client itself is unchanged"
    );
    let e = quick
        .get(&key("svc/k"), &dir.path().join("out"), Progress::none())
        .await
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("get of svc/k timed out after 200ms while connecting to the metadata server"),
        "{msg}"
    );
    let e = quick.ls(&KeyPrefix::root()).await.unwrap_err();
    assert!(
        e.to_string().contains("ls of  timed out after 200ms"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_key_with_keys_below_it_says_did_you_mean() {
    let c = Cluster::start().await;
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path(), &[("f", b"shard")]);
    let client = c.client();
    client
        .put(
            &key("svc/train/shard-0"),
            &dir.path().join("f"),
            PutOptions::default(),
            Progress::none(),
        )
        .await
        .unwrap();
    let e = client
        .get(&key("svc/train"), &dir.path().join("out"), Progress::none())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
    assert!(e.to_string().contains("did you mean `svc/train/`?"), "{e}");
    // A key missing with nothing below it: no hint.
    let e = client
        .get(
            &key("svc/nothing"),
            &dir.path().join("out"),
            Progress::none(),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
    assert!(!e.to_string().contains("did you mean"), "{e}");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_names_its_shared_memory_directory() {
    let c = Cluster::start().await;
    let agent = c.start_agent("pod-shm").await;
    let shm = c.shm_dir().canonicalize().unwrap();
    let dir = kt_client::agent::shared_memory_dir(agent.socket())
        .await
        .unwrap();
    assert_eq!(dir, Some(shm.clone()));
    // This process's host tensors now go there, KT_SHM_DIR or not.
    let t = HostTensor::zeros(DType::F32, &[4]).unwrap();
    let MemHandle::Shm { path, .. } = t.handle() else {
        panic!("a host tensor lends shared memory");
    };
    assert!(std::path::Path::new(&path).starts_with(&shm), "{path}");
    // No agent: none.
    let none = kt_client::agent::shared_memory_dir(&c.shm_dir().join("no.sock"))
        .await
        .unwrap();
    assert_eq!(none, None);
    agent.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_told_to_exit_when_idle_ends_with_its_last_client() {
    let c = Cluster::start().await;
    let run = tempfile::tempdir().unwrap();
    let grace = Duration::from_millis(200);
    let mut cfg = kt_agent::Config::new(
        "pod-idle",
        c.metadata_url(),
        kt_service::Token::new(TOKEN).unwrap(),
        run.path().join("agent.sock"),
    );
    cfg.shm_dir = c.shm_dir();
    cfg.exit_when_idle = Some(grace);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handle = kt_agent::start(listener, cfg, Default::default()).unwrap();
    let mut conn = ControlClient::connect(&handle.socket).await.unwrap();
    let hello = conn
        .ask(&ControlRequest::Hello {
            version: CONTROL_VERSION,
            keepalive: false,
        })
        .await;
    assert!(
        matches!(hello, Some(ControlReply::Hello { .. })),
        "{hello:?}"
    );
    // Connected for several graces: it stays.
    tokio::time::sleep(grace * 4).await;
    assert!(!handle.task.is_finished(), "an agent with a client stays");
    drop(conn);
    let task = handle.task;
    wait_until("the idle agent to end", WAIT, || {
        let done = task.is_finished();
        async move { done }
    })
    .await;
    task.await.unwrap().unwrap();
    c.stop().await;
}
