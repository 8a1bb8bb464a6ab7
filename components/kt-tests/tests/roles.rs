//! Least privilege: every route of the metadata server, the store and an
//! agent, called with a token of every role. A role a route does not allow
//! gets 403 `forbidden`; one it allows never does (whatever else the empty
//! request earns it); admin passes everywhere. The table below is the
//! contract, written out apart from the routers that enforce it.

use std::time::Duration;

use kt_service::{Auth, Token};
use kt_types::ErrorCode;
use kt_types::auth::{AuthFile, Grant, Role};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const ADMIN: &str = "admin-token-0123456789";
const STORE: &str = "store-token-0123456789";
const AGENT: &str = "agent-token-pod-a-0123";
/// Agents pod-b and pod-c (quorum membership).
const AGENT_B: &str = "agent-token-pod-b-0123";
const AGENT_C: &str = "agent-token-pod-c-0123";
const WORKLOAD: &str = "workload-token-0123456";
/// A workload given service `train` alone.
const TRAIN: &str = "workload-train-0123456";
/// Pod pod-a: its agent and its workload in one token.
const POD: &str = "pod-token-pod-a-012345";
/// Prometheus.
const METRICS: &str = "metrics-token-01234567";
/// A workload writing `eval` that reads nothing else (`reads: []`).
const EVAL: &str = "workload-eval-only-0123";
/// A workload writing `eval` that also reads `train`.
const EVAL_READS_TRAIN: &str = "workload-eval-train-012";
/// Pod pod-e, writing `eval` and reading nothing else.
const POD_EVAL: &str = "pod-token-pod-e-012345";
/// Agent pod-f, registering `eval`'s local keys only and reading nothing else.
const AGENT_EVAL: &str = "agent-token-pod-f-0123";
/// The node-cache agent of node n1.
const NODE_CACHE: &str = "agent-token-node-n1-012";

fn token_of(role: Role) -> &'static str {
    match role {
        Role::Admin => ADMIN,
        Role::Store => STORE,
        Role::Agent => AGENT,
        Role::Workload => WORKLOAD,
        Role::Pod => POD,
        Role::Metrics => METRICS,
    }
}

fn auth_file(dir: &std::path::Path) -> Auth {
    let grant = |token: &str, role, name: Option<&str>| Grant {
        token: token.into(),
        role,
        name: name.map(str::to_owned),
        services: None,
        reads: None,
    };
    let scoped = |g: Grant, reads: &[&str]| Grant {
        services: Some(vec!["eval".into()]),
        reads: Some(reads.iter().map(|s| s.to_string()).collect()),
        ..g
    };
    let file = AuthFile {
        tokens: vec![
            grant(ADMIN, Role::Admin, None),
            grant(STORE, Role::Store, None),
            grant(AGENT, Role::Agent, Some("pod-a")),
            grant(AGENT_B, Role::Agent, Some("pod-b")),
            grant(AGENT_C, Role::Agent, Some("pod-c")),
            grant(WORKLOAD, Role::Workload, None),
            grant(POD, Role::Pod, Some("pod-a")),
            grant(METRICS, Role::Metrics, None),
            Grant {
                services: Some(vec!["train".into()]),
                ..grant(TRAIN, Role::Workload, None)
            },
            scoped(grant(EVAL, Role::Workload, None), &[]),
            scoped(grant(EVAL_READS_TRAIN, Role::Workload, None), &["train"]),
            scoped(grant(POD_EVAL, Role::Pod, Some("pod-e")), &[]),
            scoped(grant(AGENT_EVAL, Role::Agent, Some("pod-f")), &[]),
            grant(NODE_CACHE, Role::Agent, Some("node-n1")),
        ],
    };
    let path = dir.join("auth.json");
    std::fs::write(&path, serde_json::to_vec(&file).unwrap()).unwrap();
    Auth::from_file(&path).unwrap()
}

use Role::{Agent as A, Metrics as M, Store as S, Workload as W};

/// (server, method, path, roles allowed besides admin; a pod goes where
/// an agent or a workload may). `node-cache`: a node-cache agent's own
/// routes (it serves an agent's too). tidy's `roles_table` checks this
/// against the routers' `allow` lists, both ways.
const TABLE: &[(&str, &str, &str, &[Role])] = &[
    ("meta", "POST", "/api/v1/stores", &[S]),
    ("meta", "GET", "/api/v1/store", &[W, A, S]),
    ("meta", "GET", "/api/v1/keys?prefix=", &[W]),
    ("meta", "GET", "/api/v1/keys/a/b", &[W, A, S]),
    ("meta", "PUT", "/api/v1/keys/a/b", &[S, A]),
    ("meta", "DELETE", "/api/v1/keys/a/b", &[W, A]),
    ("meta", "GET", "/api/v1/owners/a/b", &[S]),
    ("meta", "POST", "/api/v1/tensors/grants/a/b", &[A]),
    ("meta", "POST", "/api/v1/keys/a/b", &[W]),
    ("meta", "GET", "/api/v1/leases", &[]),
    ("meta", "PUT", "/api/v1/leases/l1", &[W]),
    ("meta", "DELETE", "/api/v1/leases/l1", &[W]),
    ("meta", "POST", "/api/v1/leases/l1/failed", &[W]),
    ("meta", "POST", "/api/v1/agents", &[A]),
    ("meta", "GET", "/api/v1/agents", &[]),
    ("meta", "GET", "/api/v1/status", &[]),
    ("meta", "DELETE", "/api/v1/services/train", &[W]),
    ("meta", "GET", "/api/v1/broadcasts/join", &[W]),
    ("meta", "GET", "/api/v1/broadcasts/g1", &[]),
    ("meta", "GET", "/api/v1/quorums/g1", &[]),
    ("meta", "POST", "/api/v1/quorums/g1/join", &[A]),
    ("meta", "GET", "/api/v1/quorums/g1/t1", &[]),
    ("meta", "GET", "/api/v1/quorums/g1/t1/rendezvous", &[A]),
    ("meta", "PUT", "/api/v1/quorums/g1/t1/rendezvous", &[A]),
    ("meta", "POST", "/api/v1/quorums/g1/t1/done", &[A]),
    ("meta", "POST", "/api/v1/auth/review", &[S, A]),
    ("meta", "GET", "/metrics", &[M]),
    ("store", "POST", "/api/v1/puts", &[W]),
    ("store", "PUT", "/api/v1/puts/s1/batch", &[W]),
    ("store", "PUT", "/api/v1/puts/s1/files/0/chunks/0", &[W]),
    ("store", "POST", "/api/v1/puts/s1/commit", &[W]),
    ("store", "DELETE", "/api/v1/puts/s1", &[W]),
    ("store", "GET", "/api/v1/trees", &[]),
    ("store", "GET", "/api/v1/trees/a/b", &[W]),
    ("store", "DELETE", "/api/v1/trees/a/b", &[]),
    ("store", "POST", "/api/v1/reads/l1/batch", &[W]),
    (
        "store",
        "GET",
        "/api/v1/reads/l1/files/0?offset=0&len=1",
        &[W],
    ),
    ("store", "DELETE", "/api/v1/reads/l1", &[W]),
    ("store", "GET", "/metrics", &[M]),
    ("agent", "GET", "/api/v1/trees/a/b", &[W]),
    ("agent", "POST", "/api/v1/reads/l1/batch", &[W]),
    (
        "agent",
        "GET",
        "/api/v1/reads/l1/files/0?offset=0&len=1",
        &[W],
    ),
    ("agent", "DELETE", "/api/v1/reads/l1", &[W]),
    ("agent", "POST", "/api/v1/tensors/sessions", &[A, W]),
    ("agent", "GET", "/metrics", &[M]),
    ("node-cache", "GET", "/api/v1/datasets", &[]),
    ("node-cache", "PUT", "/api/v1/datasets/ns/ds", &[]),
    ("node-cache", "DELETE", "/api/v1/datasets/ns/ds", &[]),
];

struct Running(CancellationToken, Vec<tokio::task::JoinHandle<()>>);

/// A metadata server, a store and agent pod-a, each with its own role's
/// token, all accepting the tokens of [`auth_file`].
struct Servers {
    meta: String,
    store: String,
    agent: String,
    /// A node-cache agent (node n1).
    node_cache: String,
    /// pod-a's control socket.
    socket: std::path::PathBuf,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Servers {
    async fn start(dir: &std::path::Path) -> Servers {
        let auth = auth_file(dir);
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();

        // Each server calls the others with its own role's token.
        let meta_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let meta_url = format!("http://{}", meta_l.local_addr().unwrap());
        let mut meta = kt_metadata::Config::new(dir.join("meta"), Token::new(ADMIN).unwrap());
        meta.server.auth = Some(auth.clone());
        let s = stop.clone();
        tasks.push(tokio::spawn(async move {
            kt_metadata::run(meta_l, meta, s).await.unwrap();
        }));
        let store_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let store_url = format!("http://{}", store_l.local_addr().unwrap());
        let mut store = kt_store::Config::new(
            dir.join("store"),
            meta_url.clone(),
            Token::new(STORE).unwrap(),
        );
        store.server.auth = Some(auth.clone());
        let h = kt_store::start(store_l, store, stop.clone()).unwrap();
        tasks.push(tokio::spawn(async move {
            let _ = h.task.await;
        }));
        let agent_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let agent_url = format!("http://{}", agent_l.local_addr().unwrap());
        let mut agent = kt_agent::Config::new(
            "pod-a",
            meta_url.clone(),
            Token::new(AGENT).unwrap(),
            dir.join("agent/agent.sock"),
        );
        agent.server.auth = Some(auth.clone());
        agent.shm_dir = dir.join("shm");
        std::fs::create_dir_all(&agent.shm_dir).unwrap();
        let h = kt_agent::start(agent_l, agent, stop.clone()).unwrap();
        tasks.push(tokio::spawn(async move {
            let _ = h.task.await;
        }));
        let nc_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let nc_url = format!("http://{}", nc_l.local_addr().unwrap());
        let mut nc = kt_agent::datasets::NodeCacheConfig::new("n1");
        nc.root = dir.join("datasets");
        let mut node_cache = kt_agent::Config::new(
            "node-n1",
            meta_url.clone(),
            Token::new(NODE_CACHE).unwrap(),
            dir.join("nc/agent.sock"),
        );
        node_cache.state_dir = nc.state_dir();
        node_cache.node_cache = Some(nc);
        node_cache.server.auth = Some(auth);
        node_cache.shm_dir = dir.join("shm");
        let h = kt_agent::start(nc_l, node_cache, stop.clone()).unwrap();
        tasks.push(tokio::spawn(async move {
            let _ = h.task.await;
        }));
        // The store registered itself with its store token: the store role
        // works end to end (GET /store answers its URL once it has).
        let http = kt_api::client();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let r = http
                .get(format!("{meta_url}/api/v1/store"))
                .bearer_auth(WORKLOAD)
                .send()
                .await
                .unwrap();
            if r.status().is_success() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the store never registered"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        Servers {
            meta: meta_url,
            store: store_url,
            agent: agent_url,
            node_cache: nc_url,
            socket: dir.join("agent/agent.sock"),
            stop,
            tasks,
        }
    }

    async fn stop(mut self) {
        self.stop.cancel();
        for t in std::mem::take(&mut self.tasks) {
            let _ = tokio::time::timeout(Duration::from_secs(15), t).await;
        }
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_answers_only_the_roles_it_allows() {
    let dir = tempfile::tempdir().unwrap();
    let servers = Servers::start(dir.path()).await;
    let (meta_url, store_url, agent_url) = (&servers.meta, &servers.store, &servers.agent);
    let http = kt_api::client();

    let mut wrong = Vec::new();
    for (server, method, path, allowed) in TABLE {
        let base = match *server {
            "meta" => &meta_url,
            "store" => &store_url,
            "node-cache" => &&servers.node_cache,
            _ => &agent_url,
        };
        for role in Role::ALL {
            let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
            let resp = http
                .request(m, format!("{base}{path}"))
                .bearer_auth(token_of(role))
                .timeout(Duration::from_secs(10))
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let may = match role {
                Role::Admin => true,
                Role::Pod => allowed.contains(&A) || allowed.contains(&W),
                r => allowed.contains(&r),
            };
            if status == 401 || (status == 403) == may {
                wrong.push(format!(
                    "{server} {method} {path} as {role}: {status} (allowed: {may})"
                ));
            }
            if status == 403 {
                let body: kt_types::ErrorBody = resp.json().await.unwrap();
                assert_eq!(body.error.code, ErrorCode::Forbidden);
                assert!(
                    body.error.message.contains(role.as_str()),
                    "{}",
                    body.error.message
                );
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));

    // A workload limited to `train` puts train's keys, not another
    // service's, and cannot take one over by naming its own service.
    let src = dir.path().join("src.txt");
    std::fs::write(&src, b"weights").unwrap();
    let put = |token: &'static str, key: &'static str, service: Option<&'static str>| {
        kt_tests::put_as(meta_url, dir.path(), token, key, &src, service)
    };
    assert_eq!(put(TRAIN, "train/w", None).await, Ok(()));
    assert_eq!(put(WORKLOAD, "eval/w", None).await, Ok(()));
    assert_eq!(
        put(TRAIN, "eval/x", Some("eval")).await,
        Err(Some(ErrorCode::Forbidden))
    );
    // Naming no service, a token that writes one puts into it.
    assert_eq!(put(TRAIN, "ckpt/x", None).await, Ok(()));
    let record: kt_types::KeyRecord = http
        .get(format!("{meta_url}/api/v1/keys/ckpt/x"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(record.service, "train");
    assert_eq!(
        put(TRAIN, "eval/w", Some("train")).await,
        Err(Some(ErrorCode::Forbidden)),
        "taking eval/w over by naming train"
    );

    // A broadcast whose getters hold different tokens (as pods do, each
    // its own ServiceAccount's): a child presents its parent relay's key,
    // so the chain holds without falling back to the store.
    let getters = [WORKLOAD, POD, TRAIN].map(|token| {
        let mut cfg = kt_client::ClientConfig::new(meta_url.clone(), token);
        cfg.cache_dir = Some(dir.path().join(format!("bc-cache-{token}")));
        cfg.agent_socket = dir.path().join("no-agent.sock");
        let client = kt_client::Client::new(cfg).unwrap();
        let dest = dir.path().join(format!("bc-{token}"));
        async move {
            let options = kt_client::broadcast::BroadcastOptions {
                group: Some("chain".into()),
                fanout: Some(1),
                window: Some(Duration::from_secs(30)),
                delete: false,
            };
            let key = kt_types::Key::parse("train/w").unwrap();
            let s = client
                .get_broadcast(&key, &dest, &options, kt_client::Progress::none())
                .await
                .expect("broadcast get");
            (std::fs::read(&dest).unwrap(), s)
        }
    });
    let mut got = futures::future::join_all(getters).await;
    got.sort_by_key(|(_, s)| s.rank);
    for (bytes, s) in &got {
        assert_eq!(bytes, b"weights");
        assert_eq!(s.parents, vec![s.rank - 1], "rank {} moved parents", s.rank);
    }
    assert_eq!(got[0].1.relayed, 7, "rank 1 relayed to rank 2");
    servers.stop().await;
}

/// Reads within services: a token given `reads` gets, lists and receives
/// only its own services' keys and those it lists, at the metadata server
/// and at every server that holds data (the store, an agent's exports, an
/// agent's tensor sessions, quorums, broadcasts); a token without `reads`
/// reads every service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_get_only_the_services_their_tokens_read() {
    use kt_types::ErrorCode::Forbidden;
    let dir = tempfile::tempdir().unwrap();
    let servers = Servers::start(dir.path()).await;
    let client = |token: &'static str| {
        let mut cfg = kt_client::ClientConfig::new(servers.meta.clone(), token);
        cfg.cache_dir = Some(dir.path().join(format!("cache-{token}")));
        cfg.agent_socket = dir.path().join("no-agent.sock");
        kt_client::Client::new(cfg).unwrap()
    };
    let key = |k: &str| kt_types::Key::parse(k).unwrap();
    let src = dir.path().join("src.txt");
    std::fs::write(&src, b"weights").unwrap();
    for k in ["train/w", "eval/x"] {
        client(WORKLOAD)
            .put(
                &key(k),
                &src,
                Default::default(),
                kt_client::Progress::none(),
            )
            .await
            .unwrap();
    }
    // pod-a's agent serves train/local in place (its service: train).
    let tree = dir.path().join("tree");
    std::fs::create_dir_all(&tree).unwrap();
    std::fs::write(tree.join("f"), b"local weights").unwrap();
    let reply = kt_tests::ControlClient::open(&servers.socket)
        .await
        .ask(&kt_types::agent::ControlRequest::ExportLocal {
            key: key("train/local"),
            path: tree.display().to_string(),
            options: Default::default(),
        })
        .await
        .unwrap();
    assert!(
        matches!(reply, kt_types::agent::ControlReply::Exported { .. }),
        "{reply:?}"
    );

    let http = kt_api::client();
    let call = |method: &str, url: String, token: &str, body: Option<serde_json::Value>| {
        let mut r = http
            .request(reqwest::Method::from_bytes(method.as_bytes()).unwrap(), url)
            .bearer_auth(token);
        if let Some(b) = body {
            r = r.json(&b);
        }
        async move {
            let resp = r.send().await.unwrap();
            let status = resp.status().as_u16();
            (status, resp.text().await.unwrap())
        }
    };
    let (meta, store, agent) = (&servers.meta, &servers.store, &servers.agent);
    let session = |k: &str| {
        serde_json::json!({
            "keys": [{ "key": k, "tensors": [] }], "agent": "pod-e", "ip": "127.0.0.1",
            "endpoint": "127.0.0.1:1", "backend": "host"
        })
    };
    let quorum_get = serde_json::json!({
        "agent": "pod-e", "ip": "127.0.0.1", "endpoint": "127.0.0.1:1", "backend": "host",
        "role": "get", "keys": [{ "key": "train/w", "tensors": [] }],
        "window": { "world_size": 2 }
    });
    let refused = [
        ("GET", format!("{meta}/api/v1/keys/train/w"), EVAL, None),
        (
            "POST",
            format!("{meta}/api/v1/keys/train/w/lease"),
            EVAL,
            Some(serde_json::json!({})),
        ),
        ("GET", format!("{store}/api/v1/trees/train/w"), EVAL, None),
        (
            "GET",
            format!("{agent}/api/v1/trees/train/local"),
            EVAL,
            None,
        ),
        (
            "GET",
            format!("{agent}/api/v1/trees/train/local"),
            POD_EVAL,
            None,
        ),
        (
            "POST",
            format!("{agent}/api/v1/tensors/sessions"),
            POD_EVAL,
            Some(session("train/w")),
        ),
        (
            "POST",
            format!("{meta}/api/v1/tensors/grants/train/w"),
            POD_EVAL,
            Some(serde_json::json!({ "getter": "pod-e" })),
        ),
        (
            "POST",
            format!("{meta}/api/v1/quorums/g/join"),
            POD_EVAL,
            Some(quorum_get),
        ),
    ];
    for (method, url, token, body) in refused {
        let (status, text) = call(method, url.clone(), token, body).await;
        assert_eq!(status, 403, "{method} {url}: {text}");
        let body: kt_types::ErrorBody = serde_json::from_str(&text).unwrap();
        assert!(
            body.error.message.contains("service \"train\""),
            "{method} {url}: {text}"
        );
    }
    // Its own service, a listed one, or a token without `reads`: served.
    let served = [
        ("GET", format!("{meta}/api/v1/keys/eval/x"), EVAL),
        (
            "GET",
            format!("{meta}/api/v1/keys/train/w"),
            EVAL_READS_TRAIN,
        ),
        ("GET", format!("{meta}/api/v1/keys/train/w"), TRAIN),
        ("GET", format!("{store}/api/v1/trees/eval/x"), EVAL),
        (
            "GET",
            format!("{store}/api/v1/trees/train/w"),
            EVAL_READS_TRAIN,
        ),
        (
            "GET",
            format!("{agent}/api/v1/trees/train/local"),
            EVAL_READS_TRAIN,
        ),
        ("GET", format!("{agent}/api/v1/trees/train/local"), WORKLOAD),
    ];
    for (method, url, token) in served {
        let (status, text) = call(method, url.clone(), token, None).await;
        assert_eq!(status, 200, "{method} {url}: {text}");
    }
    // A tensor session for its own service's key passes the check (and
    // fails later: this agent holds no such tensors).
    let (status, text) = call(
        "POST",
        format!("{agent}/api/v1/tensors/sessions"),
        POD_EVAL,
        Some(session("eval/x")),
    )
    .await;
    assert_ne!(status, 403, "{text}");

    // A quorum getter that joined before the key was registered is checked
    // when the quorum closes, before its plan is made: it gets 403 and no
    // rank, and the round goes on without it (pod-b puts to pod-c).
    {
        use kt_types::tensor::{
            BackendKind, DType, QuorumJoin, QuorumKey, QuorumRole, TensorDesc, TensorMeta,
        };
        let keys = vec![QuorumKey {
            from: None,
            key: key("train/q"),
            version: "v1".into(),
            tensors: vec![TensorDesc {
                name: "w".into(),
                meta: TensorMeta::new(DType::F32, [4]),
            }],
        }];
        let join = |agent: &str, token: &'static str, role: QuorumRole| {
            let body = QuorumJoin {
                member: String::new(),
                node: String::new(),
                agent: agent.into(),
                ip: "127.0.0.1".into(),
                endpoint: "127.0.0.1:1".into(),
                backend: BackendKind::Host,
                role,
                window: kt_types::BroadcastWindow {
                    world_size: Some(3),
                    timeout_secs: Some(30.0),
                    ..Default::default()
                },
                comms: Vec::new(),
            };
            let body = serde_json::to_value(body).unwrap();
            call(
                "POST",
                format!("{meta}/api/v1/quorums/late/join"),
                token,
                Some(body),
            )
        };
        let early = join("pod-e", POD_EVAL, QuorumRole::Get { keys: keys.clone() });
        let allowed = join("pod-c", AGENT_C, QuorumRole::Get { keys: keys.clone() });
        let putter = async {
            // The getters are waiting in the quorum before the key exists.
            kt_tests::wait_until("the getters' joins", Duration::from_secs(10), || async {
                let (_, text) =
                    call("GET", format!("{meta}/api/v1/quorums/late"), ADMIN, None).await;
                serde_json::from_str::<kt_types::tensor::QuorumInfo>(&text)
                    .is_ok_and(|i| i.open.is_some_and(|r| r.members.len() == 2))
            })
            .await;
            let reg = serde_json::json!({
                "locale": "local", "source": "http://10.0.0.2:8100", "holder": "pod-b",
                "version": "v1", "is_dir": false, "size": 16, "files": 1, "service": "train",
                "digest": "0000000000000000000000000000000000000000000000000000000000000000"
            });
            let (status, text) = call(
                "PUT",
                format!("{meta}/api/v1/keys/train/q"),
                AGENT_B,
                Some(reg),
            )
            .await;
            assert_eq!(status, 200, "{text}");
            join("pod-b", AGENT_B, QuorumRole::Put { keys: keys.clone() }).await
        };
        let ((get_status, get_text), (c_status, c_text), (put_status, put_text)) =
            tokio::join!(early, allowed, putter);
        assert_eq!(put_status, 200, "{put_text}");
        assert_eq!(c_status, 200, "{c_text}");
        assert_eq!(get_status, 403, "{get_text}");
        assert!(get_text.contains("train"), "{get_text}");
        let plan: kt_types::tensor::QuorumPlan = serde_json::from_str(&put_text).unwrap();
        let ranks: Vec<&str> = plan.plan.ranks.iter().map(|r| r.agent.as_str()).collect();
        assert_eq!(ranks, ["pod-b", "pod-c"], "the refused getter has no rank");
    }

    // `kt ls` shows only the keys it may read; `kt get` and broadcasts
    // of another service are refused.
    let listed = |token: &'static str| {
        let c = client(token);
        async move {
            let l = c.ls_below(&kt_types::KeyPrefix::root()).await.unwrap();
            l.entries.into_iter().map(|e| e.key).collect::<Vec<_>>()
        }
    };
    assert_eq!(listed(EVAL).await, ["eval/x"]);
    // Nor do deletes tell it of another service's keys: their versions,
    // that keys lie below a name, or their names, services and holders.
    for path in ["train/w?version=bogus", "train", "train?recursive=true"] {
        let (status, text) = call("DELETE", format!("{meta}/api/v1/keys/{path}"), EVAL, None).await;
        assert_eq!(status, 404, "{path}: {text}");
        for told in ["at version", "below", "service", "pod-"] {
            assert!(!text.contains(told), "{path}: {text}");
        }
    }
    assert_eq!(listed(WORKLOAD).await.len(), 4, "nothing was deleted");
    assert_eq!(
        listed(EVAL_READS_TRAIN).await,
        ["eval/x", "train/local", "train/q", "train/w"]
    );
    assert_eq!(listed(WORKLOAD).await.len(), 4);
    let dest = dir.path().join("got");
    let got = client(EVAL)
        .get(&key("train/w"), &dest, kt_client::Progress::none())
        .await;
    assert_eq!(got.map(|_| ()).map_err(|e| e.code()), Err(Some(Forbidden)));
    assert!(!dest.exists(), "a refused get wrote nothing");
    let options = kt_client::broadcast::BroadcastOptions {
        group: None,
        fanout: None,
        window: Some(Duration::from_secs(5)),
        delete: false,
    };
    let got = client(EVAL)
        .get_broadcast(
            &key("train/w"),
            &dest,
            &options,
            kt_client::Progress::none(),
        )
        .await;
    assert_eq!(got.map(|_| ()).map_err(|e| e.code()), Err(Some(Forbidden)));
    client(EVAL_READS_TRAIN)
        .get(&key("train/w"), &dest, kt_client::Progress::none())
        .await
        .unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), b"weights");
    servers.stop().await;
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.cancel();
        self.1.clear();
    }
}

/// A metadata server on `127.0.0.1:0` with [`auth_file`]'s roles, its data
/// under `dir`: its URL, the token that stops it and its task.
async fn start_metadata(
    dir: &std::path::Path,
) -> (String, CancellationToken, tokio::task::JoinHandle<()>) {
    let stop = CancellationToken::new();
    let meta_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", meta_l.local_addr().unwrap());
    let mut meta = kt_metadata::Config::new(dir.join("meta"), Token::new(ADMIN).unwrap());
    meta.server.auth = Some(auth_file(dir));
    let s = stop.clone();
    let task = tokio::spawn(async move {
        kt_metadata::run(meta_l, meta, s).await.unwrap();
    });
    (url, stop, task)
}

/// Beyond the route: an agent acts only as itself, the store registers
/// only store keys, a workload touches only its services' keys; a refused
/// call changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_act_as_themselves_and_workloads_within_their_services() {
    let dir = tempfile::tempdir().unwrap();
    let (url, stop, task) = start_metadata(dir.path()).await;
    let _running = Running(stop.clone(), Vec::new());
    let http = kt_api::client();
    let call = |method: &str, path: &str, token: &str, body: Option<serde_json::Value>| {
        let mut r = http
            .request(
                reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
                format!("{url}{path}"),
            )
            .bearer_auth(token);
        if let Some(b) = body {
            r = r.json(&b);
        }
        async move { r.send().await.unwrap().status().as_u16() }
    };
    // Heartbeats and quorum joins only as the token's agent.
    let beat = |id: &str| serde_json::json!({ "id": id, "url": "http://10.0.0.1:8100" });
    assert_eq!(
        call("POST", "/api/v1/agents", AGENT, Some(beat("pod-b"))).await,
        403
    );
    assert_eq!(
        call("POST", "/api/v1/agents", AGENT, Some(beat("pod-a"))).await,
        200
    );
    let join = serde_json::json!({
        "agent": "pod-b", "ip": "10.0.0.2", "endpoint": "10.0.0.2:1", "backend": "host",
        "role": "put", "keys": [{ "key": "train/w", "version": "v", "tensors": [] }],
        "window": { "world_size": 2, "fanout": 2 }
    });
    assert_eq!(
        call("POST", "/api/v1/quorums/g1/join", AGENT, Some(join)).await,
        403
    );
    // Key registrations: an agent's own local keys, the store's store keys.
    let reg = |holder: Option<&str>, locale: &str, service: &str| {
        serde_json::json!({
            "locale": locale, "source": "http://10.0.0.1:8100", "holder": holder,
            "version": "v1", "is_dir": false, "size": 1, "files": 1, "service": service,
            "digest": "0000000000000000000000000000000000000000000000000000000000000000"
        })
    };
    for (token, body) in [
        (AGENT, reg(Some("pod-b"), "local", "eval")),
        (AGENT, reg(None, "store", "eval")),
        (STORE, reg(Some("pod-a"), "local", "eval")),
    ] {
        assert_eq!(
            call("PUT", "/api/v1/keys/eval/x", token, Some(body)).await,
            403
        );
    }
    assert_eq!(
        call("GET", "/api/v1/keys/eval/x", ADMIN, None).await,
        404,
        "nothing registered"
    );
    let ok = reg(Some("pod-a"), "local", "eval");
    assert_eq!(
        call("PUT", "/api/v1/keys/eval/x", AGENT, Some(ok.clone())).await,
        200
    );
    assert_eq!(
        call(
            "PUT",
            "/api/v1/keys/train/y",
            AGENT,
            Some(reg(Some("pod-a"), "local", "train"))
        )
        .await,
        200
    );
    // A pod registers only its services' local keys, and takes none over
    // by naming its own service; an agent given services likewise.
    for (path, token, holder, service, want) in [
        ("/api/v1/keys/train/z", POD_EVAL, "pod-e", "train", 403),
        ("/api/v1/keys/train/y", POD_EVAL, "pod-e", "eval", 403),
        ("/api/v1/keys/eval/z", POD_EVAL, "pod-e", "eval", 200),
        ("/api/v1/keys/train/z", AGENT_EVAL, "pod-f", "train", 403),
        ("/api/v1/keys/eval/w", AGENT_EVAL, "pod-f", "eval", 200),
    ] {
        let body = reg(Some(holder), "local", service);
        assert_eq!(call("PUT", path, token, Some(body)).await, want, "{path}");
    }
    assert_eq!(call("GET", "/api/v1/keys/train/z", ADMIN, None).await, 404);
    // A workload deletes and tears down only within its services; what it
    // is refused stays. An agent given reads reads only those.
    for (method, path, token, want) in [
        ("GET", "/api/v1/keys/train/y", AGENT_EVAL, 403),
        ("GET", "/api/v1/keys/eval/x", AGENT_EVAL, 200),
        ("DELETE", "/api/v1/keys/eval/x", TRAIN, 403),
        ("DELETE", "/api/v1/keys/eval?recursive=true", TRAIN, 403),
        ("DELETE", "/api/v1/services/eval", TRAIN, 403),
        ("GET", "/api/v1/keys/eval/x", ADMIN, 200),
        ("DELETE", "/api/v1/keys/train/y", TRAIN, 200),
        ("DELETE", "/api/v1/services/train", TRAIN, 200),
        ("DELETE", "/api/v1/keys/eval/x", WORKLOAD, 200),
    ] {
        assert_eq!(
            call(method, path, token, None).await,
            want,
            "{method} {path}"
        );
    }
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
}

/// A quorum transfer answers only its members: rank 0 publishes the
/// rendezvous, members read it, each rank reports for itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_transfers_answer_only_their_members() {
    use kt_types::tensor::{
        BackendKind, DType, QuorumJoin, QuorumKey, QuorumPlan, QuorumRole, TensorDesc, TensorMeta,
    };
    let dir = tempfile::tempdir().unwrap();
    let (url, stop, task) = start_metadata(dir.path()).await;
    let _running = Running(stop.clone(), Vec::new());
    let http = kt_api::client();
    let window = kt_types::BroadcastWindow {
        world_size: Some(2),
        timeout_secs: Some(60.0),
        ..kt_types::BroadcastWindow::default()
    };
    let keys = vec![QuorumKey {
        from: None,
        key: kt_types::Key::parse("q/w").unwrap(),
        version: "v1".into(),
        tensors: vec![TensorDesc {
            name: "w".into(),
            meta: TensorMeta::new(DType::F32, [4]),
        }],
    }];
    let join = |agent: &str, token: &'static str, role: QuorumRole, n: u8| {
        let body = QuorumJoin {
            member: String::new(),
            node: String::new(),
            agent: agent.into(),
            ip: format!("10.0.0.{n}"),
            endpoint: format!("10.0.0.{n}:8100"),
            backend: BackendKind::Host,
            role,
            window: window.clone(),
            comms: Vec::new(),
        };
        let req = http
            .post(format!("{url}/api/v1/quorums/g/join"))
            .bearer_auth(token)
            .json(&body);
        async move {
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.json::<QuorumPlan>().await.unwrap()
        }
    };
    let (a, b) = tokio::join!(
        join("pod-a", AGENT, QuorumRole::Put { keys: keys.clone() }, 1),
        join("pod-b", AGENT_B, QuorumRole::Get { keys }, 2),
    );
    let id = a.plan.id.clone();
    let token_of_rank = |r: u32| if r == a.rank { AGENT } else { AGENT_B };
    let (rank0, rank1) = (token_of_rank(0), token_of_rank(1));
    let call = |method: &str, path: &str, token: &str, body: Option<serde_json::Value>| {
        let mut r = http
            .request(
                reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
                format!("{url}/api/v1/quorums/g/{id}/{path}"),
            )
            .bearer_auth(token);
        if let Some(b) = body {
            r = r.json(&b);
        }
        async move { r.send().await.unwrap().status().as_u16() }
    };
    let blob = serde_json::json!({"blob": "00ff"});
    assert_eq!(b.plan.id, id);
    // Outsiders and other ranks are refused, and change nothing.
    assert_eq!(
        call("PUT", "rendezvous", rank1, Some(blob.clone())).await,
        403
    );
    assert_eq!(
        call("PUT", "rendezvous", AGENT_C, Some(blob.clone())).await,
        403
    );
    assert_eq!(
        call("GET", "rendezvous?wait_ms=0", AGENT_C, None).await,
        403
    );
    assert_eq!(
        call("GET", "rendezvous?wait_ms=0", rank1, None).await,
        503,
        "nothing published"
    );
    for (token, rank) in [(rank1, 0), (AGENT_C, 1)] {
        let done = serde_json::json!({"rank": rank});
        assert_eq!(call("POST", "done", token, Some(done)).await, 403);
    }
    // Members do their part.
    assert_eq!(
        call("PUT", "rendezvous", rank0, Some(blob.clone())).await,
        200
    );
    assert_eq!(call("GET", "rendezvous?wait_ms=0", rank1, None).await, 200);
    for (token, rank) in [(rank0, 0), (rank1, 1)] {
        let done = serde_json::json!({"rank": rank});
        assert_eq!(call("POST", "done", token, Some(done)).await, 200);
    }
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
}
