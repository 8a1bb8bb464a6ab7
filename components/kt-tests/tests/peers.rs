//! Peers, agents and source leases of the metadata server, over HTTP.
//!
//! The tests act as node agents (heartbeats listing what they serve,
//! registrations of `locale=local` keys) and as getters (lease requests,
//! failure reports). Nothing here moves data between agents: the agents are
//! fake, only their conversation with the metadata server is real.

use std::time::Duration;

use kt_client::Progress;
use kt_service::Token;
use kt_tests::{Cluster, TOKEN, wait_until};
use kt_types::api::{
    AgentHeartbeat, AgentList, HeartbeatReply, LeaseList, LeaseRequest, PutOptions, RegisterIf,
    RegisterKey, Served, SourceFailure, SourceLease, TeardownResponse, TreeList,
};
use kt_types::{ErrorBody, ErrorCode, Key, KeyRecord, Lifespan, Locale};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

/// A bearer-token HTTP client of one server.
/// A JSON answer as its type (a macro: this crate reaches serde only through serde_json).
macro_rules! typed {
    ($v:expr) => {
        serde_json::from_value($v).unwrap()
    };
}

#[derive(Debug, Clone)]
struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    fn new(base: String) -> Self {
        Api {
            http: kt_api::client(),
            base,
        }
    }

    /// Any call: the status and the body (JSON `null` when empty).
    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let mut req = self
            .http
            .request(method, format!("{}/api/v1/{path}", self.base))
            .bearer_auth(TOKEN);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status();
        let bytes = resp.bytes().await.unwrap();
        let value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        (status, value)
    }

    /// A call that must succeed; its answer.
    async fn ok(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        let (status, value) = self.call(method.clone(), path, body).await;
        assert!(status.is_success(), "{method} {path}: {status} {value}");
        value
    }

    /// A call that must fail with `code`; its message.
    async fn err(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        code: ErrorCode,
    ) -> String {
        let (status, value) = self.call(method.clone(), path, body).await;
        assert_eq!(
            status.as_u16(),
            code.http_status(),
            "{method} {path}: {value}"
        );
        let body: ErrorBody = serde_json::from_value(value).unwrap();
        assert_eq!(body.error.code, code, "{}", body.error.message);
        body.error.message
    }

    async fn beat(
        &self,
        id: &str,
        service: Option<&str>,
        serves: &[(&str, &str)],
    ) -> HeartbeatReply {
        let hb = AgentHeartbeat {
            id: id.into(),
            url: agent_url(id),
            service: service.map(Into::into),
            serves: serves
                .iter()
                .map(|(k, v)| Served {
                    key: key(k),
                    version: (*v).into(),
                })
                .collect(),
        };
        typed!(self.ok(Method::POST, "agents", Some(json!(hb))).await)
    }

    /// What an agent sends for `kt put --locale local`.
    async fn register_local(
        &self,
        k: &str,
        holder: &str,
        version: &str,
        lifespan: Lifespan,
    ) -> KeyRecord {
        let reg = RegisterKey {
            locale: Locale::Local,
            source: agent_url(holder),
            holder: Some(holder.into()),
            version: version.into(),
            is_dir: true,
            size: 3,
            files: 1,
            tensors: None,
            digest: Some(kt_types::Hash([9; 32])),
            options: PutOptions {
                lifespan: Some(lifespan),
                ..PutOptions::default()
            },
            only_if: None,
        };
        typed!(
            self.ok(Method::PUT, &format!("keys/{k}"), Some(json!(reg)))
                .await
        )
    }

    async fn record(&self, k: &str) -> KeyRecord {
        typed!(self.ok(Method::GET, &format!("keys/{k}"), None).await)
    }

    async fn peers(&self, k: &str) -> Vec<String> {
        self.record(k)
            .await
            .peers
            .into_iter()
            .map(|p| p.id)
            .collect()
    }

    async fn agents(&self) -> Vec<String> {
        let list: AgentList = typed!(self.ok(Method::GET, "agents", None).await);
        list.agents.into_iter().map(|a| a.id).collect()
    }

    async fn leases(&self) -> LeaseList {
        typed!(self.ok(Method::GET, "leases", None).await)
    }

    fn lease_request(exclude: &[&str], getter: Option<&str>) -> LeaseRequest {
        LeaseRequest {
            exclude: exclude.iter().map(|s| s.to_string()).collect(),
            getter: getter.map(Into::into),
        }
    }

    async fn lease(&self, k: &str, exclude: &[&str], getter: Option<&str>) -> SourceLease {
        let req = Self::lease_request(exclude, getter);
        typed!(
            self.ok(Method::POST, &format!("keys/{k}/lease"), Some(json!(req)))
                .await
        )
    }

    async fn lease_err(&self, k: &str, exclude: &[&str], code: ErrorCode) -> String {
        let req = Self::lease_request(exclude, None);
        self.err(
            Method::POST,
            &format!("keys/{k}/lease"),
            Some(json!(req)),
            code,
        )
        .await
    }
}

fn agent_url(id: &str) -> String {
    // Never dialled: the agents are fake.
    format!("http://agent-{id}.invalid:8083")
}

/// A metadata server alone, with short agent and lease TTLs (no store: local
/// keys only, which must never need one).
#[derive(Debug)]
struct Meta {
    api: Api,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl Meta {
    async fn start(agent_ttl: Duration, lease_ttl: Duration) -> Meta {
        let dir = tempfile::tempdir().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let api = Api::new(format!("http://{}", listener.local_addr().unwrap()));
        let mut cfg = kt_metadata::Config::new(dir.path().join("meta"), Token::new(TOKEN).unwrap());
        cfg.sweep_interval = Duration::from_millis(20);
        cfg.heartbeat_interval = agent_ttl / 4;
        cfg.agent_ttl = agent_ttl;
        cfg.lease_ttl = lease_ttl;
        let shutdown = CancellationToken::new();
        let s = shutdown.clone();
        let task = tokio::spawn(async move {
            kt_metadata::run(listener, cfg, s).await.unwrap();
        });
        Meta {
            api,
            shutdown,
            task,
            _dir: dir,
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap();
    }
}

/// Puts `files` under `k` into the store with the real client; the version.
async fn put_store(c: &Cluster, k: &str, lifespan: Lifespan) -> String {
    let src = c.dir.path().join(format!("src-{}", k.replace('/', "_")));
    kt_tests::write_files(&src, &[("f", k.as_bytes())]);
    let opts = PutOptions {
        lifespan: Some(lifespan),
        ..PutOptions::default()
    };
    c.client()
        .put(&key(k), &src, opts, Progress::none())
        .await
        .unwrap();
    Api::new(c.metadata_url()).record(k).await.version
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_go_to_the_least_loaded_source_peers_first() {
    let c = Cluster::start().await;
    let api = Api::new(c.metadata_url());
    let v = put_store(&c, "ml/weights", Lifespan::Cluster).await;
    api.beat("p2", None, &[("ml/weights", &v)]).await;
    api.beat("p1", None, &[("ml/weights", &v)]).await;
    assert_eq!(
        api.peers("ml/weights").await,
        ["p1", "p2"],
        "peers are listed by id"
    );

    // Idle sources: peers before the origin, then by id; then round and round.
    let mut leases = Vec::new();
    for _ in 0..6 {
        leases.push(api.lease("ml/weights", &[], None).await);
    }
    let chosen: Vec<&str> = leases.iter().map(|l| l.source.id.as_str()).collect();
    assert_eq!(chosen, ["p1", "p2", "store", "p1", "p2", "store"]);
    let store = &leases[2];
    assert_eq!(store.source.url, c.store_url());
    assert_eq!(leases[0].source.url, agent_url("p1"));
    assert_eq!(store.record.version, v);
    assert_eq!(store.source.version, v);
    assert_eq!(store.ttl_ms, 30_000);
    assert_eq!(api.leases().await.leases.len(), 6);

    // Releasing one of p2's leases makes p2 the least loaded.
    let (status, _) = api
        .call(Method::DELETE, &format!("leases/{}", leases[1].lease), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(api.lease("ml/weights", &[], None).await.source.id, "p2");
    // Exclusions and the getter itself are never handed out.
    let l = api.lease("ml/weights", &["store"], Some("p1")).await;
    assert_eq!(l.source.id, "p2");
    let req = Api::lease_request(&["store", "p2"], Some("p1"));
    let msg = api
        .err(
            Method::POST,
            "keys/ml/weights/lease",
            Some(json!(req)),
            ErrorCode::NoSource,
        )
        .await;
    assert!(
        msg.starts_with("key ml/weights has no live source"),
        "{msg}"
    );
    api.lease_err("ml/nothing", &[], ErrorCode::NotFound).await;
    // Renewal extends a lease; an unknown lease is 404.
    let renewed: kt_types::api::LeaseInfo = typed!(
        api.ok(Method::PUT, &format!("leases/{}", l.lease), None)
            .await
    );
    assert_eq!((renewed.lease, renewed.source), (l.lease, "p2".to_owned()));
    api.err(Method::PUT, "leases/nope", None, ErrorCode::NotFound)
        .await;
    api.err(Method::DELETE, "leases/nope", None, ErrorCode::NotFound)
        .await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_peer_is_no_longer_offered_until_it_beats_again() {
    let c = Cluster::start().await;
    let api = Api::new(c.metadata_url());
    let v = put_store(&c, "ml/data", Lifespan::Cluster).await;
    api.beat("p1", None, &[("ml/data", &v)]).await;
    let l = api.lease("ml/data", &[], None).await;
    assert_eq!(l.source.id, "p1");
    // A transient failure (a restart, a stall) only ends the lease.
    let blip = SourceFailure {
        reason: "connection refused".into(),
        transient: true,
        key: None,
        source: None,
    };
    api.ok(
        Method::POST,
        &format!("leases/{}/failed", l.lease),
        Some(json!(blip)),
    )
    .await;
    assert_eq!(api.peers("ml/data").await, ["p1"]);
    assert!(api.leases().await.leases.is_empty());
    let l = api.lease("ml/data", &[], None).await;
    assert_eq!(l.source.id, "p1");
    let failure = SourceFailure {
        reason: "hash mismatch on f".into(),
        transient: false,
        key: None,
        source: None,
    };
    let (status, _) = api
        .call(
            Method::POST,
            &format!("leases/{}/failed", l.lease),
            Some(json!(failure)),
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    // The peer is gone from the record, and its lease with it.
    assert!(api.peers("ml/data").await.is_empty());
    assert!(api.leases().await.leases.is_empty());
    let msg = api
        .lease_err("ml/data", &["store"], ErrorCode::NoSource)
        .await;
    assert_eq!(
        msg,
        format!(
            "key ml/data has no live source: its origin the store was excluded by the getter \
             and no peer holds version {v}"
        )
    );
    // Without the exclusion the origin remains; a failed origin is only released.
    let l = api.lease("ml/data", &[], None).await;
    assert_eq!(l.source.id, "store");
    api.ok(
        Method::POST,
        &format!("leases/{}/failed", l.lease),
        Some(json!(failure)),
    )
    .await;
    assert!(api.leases().await.leases.is_empty());
    api.err(
        Method::POST,
        &format!("leases/{}/failed", l.lease),
        Some(json!(failure)),
        ErrorCode::NotFound,
    )
    .await;
    // Its next heartbeat, still serving the version, makes p1 a peer again.
    api.beat("p1", None, &[("ml/data", &v)]).await;
    assert_eq!(api.peers("ml/data").await, ["p1"]);
    // A report on a lease the server no longer knows (it restarted) still
    // counts when it names the key and the source.
    let by_key = SourceFailure {
        key: Some(Key::parse("ml/data").unwrap()),
        source: Some("p1".into()),
        ..failure.clone()
    };
    api.ok(
        Method::POST,
        "leases/forgotten-by-a-restart/failed",
        Some(json!(by_key)),
    )
    .await;
    assert!(api.peers("ml/data").await.is_empty());
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_tell_agents_what_to_drop_and_local_deletes_skip_the_store() {
    let m = Meta::start(Duration::from_secs(30), Duration::from_secs(30)).await;
    let api = &m.api;
    let r = api
        .register_local("app/out", "p1", "v1", Lifespan::Cluster)
        .await;
    assert_eq!((r.locale, r.holder.as_str()), (Locale::Local, "p1"));
    assert_eq!(r.source, agent_url("p1"));
    // Registering made p1 a known agent before its first beat.
    assert_eq!(api.agents().await, ["p1"]);
    let reply = api.beat("p1", Some("app"), &[("app/out", "v1")]).await;
    assert_eq!((reply.interval_ms, reply.ttl_ms), (7_500, 30_000));
    assert!(reply.drop.is_empty());
    // The origin serving its own key is not a peer of it.
    assert!(api.peers("app/out").await.is_empty());
    assert!(
        api.beat("p2", None, &[("app/out", "v1")])
            .await
            .drop
            .is_empty()
    );
    assert_eq!(api.peers("app/out").await, ["p2"]);

    // A new version clears the peers; p2's copy is stale, and so is an unknown key.
    api.register_local("app/out", "p1", "v2", Lifespan::Cluster)
        .await;
    assert!(api.peers("app/out").await.is_empty());
    let reply = api
        .beat("p2", None, &[("app/out", "v1"), ("app/never", "v1")])
        .await;
    assert_eq!(reply.drop, [key("app/never"), key("app/out")]);
    assert!(api.peers("app/out").await.is_empty());

    // Deleting a local key never involves a store (none is registered here).
    let del: kt_types::api::DeleteResponse =
        typed!(api.ok(Method::DELETE, "keys/app/out", None).await);
    assert_eq!(del.deleted, [key("app/out")]);
    let reply = api.beat("p1", Some("app"), &[("app/out", "v2")]).await;
    assert_eq!(reply.drop, [key("app/out")]);

    // Registrations must name their holder consistently with their locale.
    let mut bad = RegisterKey {
        locale: Locale::Local,
        source: agent_url("p1"),
        holder: None,
        version: "v".into(),
        is_dir: false,
        size: 1,
        files: 1,
        tensors: None,
        digest: Some(kt_types::Hash([9; 32])),
        options: PutOptions::default(),
        only_if: None,
    };
    let msg = api
        .err(
            Method::PUT,
            "keys/app/bad",
            Some(json!(bad)),
            ErrorCode::InvalidRequest,
        )
        .await;
    assert!(msg.contains("holder"), "{msg}");
    bad.locale = Locale::Store;
    bad.holder = Some("p1".into());
    api.err(
        Method::PUT,
        "keys/app/bad",
        Some(json!(bad)),
        ErrorCode::InvalidRequest,
    )
    .await;
    // Files without the digest of their manifest: nothing to check a
    // getter's manifest against, refused.
    bad.holder = None;
    bad.digest = None;
    let msg = api
        .err(
            Method::PUT,
            "keys/app/bad",
            Some(json!(bad)),
            ErrorCode::InvalidRequest,
        )
        .await;
    assert!(msg.contains("digest"), "{msg}");
    m.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_agents_are_evicted_and_a_key_without_sources_says_so() {
    // Agents live 1 s after a beat: long enough that the test's own beats
    // (every poll) never miss, short enough to watch evictions happen.
    let m = Meta::start(Duration::from_secs(1), Duration::from_secs(30)).await;
    let api = &m.api;
    api.register_local("app/model", "p1", "v1", Lifespan::Cluster)
        .await;
    api.beat("p2", None, &[("app/model", "v1")]).await;
    // Both idle: the peer first, offloading the origin; then the origin.
    assert_eq!(api.lease("app/model", &[], None).await.source.id, "p2");
    assert_eq!(api.lease("app/model", &[], None).await.source.id, "p1");

    // p1 falls silent while p2 keeps beating: p1 is evicted.
    wait_until("p1 evicted", WAIT, || async {
        api.beat("p2", None, &[("app/model", "v1")]).await;
        api.agents().await == ["p2"]
    })
    .await;
    // The key stays listed with its holder, served by p2 alone.
    let r = api.record("app/model").await;
    assert_eq!((r.holder.as_str(), r.peers.len()), ("p1", 1));
    assert_eq!(api.lease("app/model", &[], None).await.source.id, "p2");

    // p2 falls silent too: no source is left.
    wait_until("p2 evicted", WAIT, || async {
        api.agents().await.is_empty() && api.peers("app/model").await.is_empty()
    })
    .await;
    let msg = api.lease_err("app/model", &[], ErrorCode::NoSource).await;
    assert_eq!(
        msg,
        "key app/model has no live source: its origin pod p1 is gone and no peer holds version v1"
    );
    assert_eq!(api.record("app/model").await.holder, "p1");

    // The origin comes back: the key is served again.
    api.beat("p1", None, &[("app/model", "v1")]).await;
    assert_eq!(api.lease("app/model", &[], None).await.source.id, "p1");
    m.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_of_crashed_getters_expire() {
    let m = Meta::start(Duration::from_secs(30), Duration::from_millis(200)).await;
    let api = &m.api;
    api.register_local("app/ckpt", "p1", "v1", Lifespan::Cluster)
        .await;
    api.beat("p2", None, &[("app/ckpt", "v1")]).await;
    let first = api.lease("app/ckpt", &[], None).await;
    assert_eq!(first.source.id, "p2");
    assert_eq!(first.ttl_ms, 200);
    // The getter never renews nor releases: its lease goes, and p2's load with it.
    wait_until("the lease expires", WAIT, || async {
        api.leases().await.leases.is_empty()
    })
    .await;
    assert_eq!(api.lease("app/ckpt", &[], None).await.source.id, "p2");
    api.err(
        Method::PUT,
        &format!("leases/{}", first.lease),
        None,
        ErrorCode::NotFound,
    )
    .await;
    m.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teardown_deletes_the_services_resource_keys_and_evicts_its_agents() {
    let c = Cluster::start().await;
    let api = Api::new(c.metadata_url());
    let res = put_store(&c, "svc/res", Lifespan::Resource).await;
    let kept = put_store(&c, "svc/kept", Lifespan::Cluster).await;
    put_store(&c, "other/res", Lifespan::Resource).await;
    api.register_local("svc/local", "p1", "v1", Lifespan::Resource)
        .await;
    api.beat(
        "p1",
        Some("svc"),
        &[("svc/local", "v1"), ("svc/kept", &kept)],
    )
    .await;
    api.beat(
        "p2",
        Some("other"),
        &[("svc/res", &res), ("svc/kept", &kept)],
    )
    .await;
    assert_eq!(api.peers("svc/kept").await, ["p1", "p2"]);

    let down: TeardownResponse = typed!(api.ok(Method::DELETE, "services/svc", None).await);
    assert_eq!(down.deleted, [key("svc/local"), key("svc/res")]);
    assert_eq!(down.evicted, ["p1"]);
    // Gone from the registry, and the store-held one from the store.
    api.err(Method::GET, "keys/svc/res", None, ErrorCode::NotFound)
        .await;
    api.err(Method::GET, "keys/svc/local", None, ErrorCode::NotFound)
        .await;
    let trees: TreeList = typed!(Api::new(c.store_url()).ok(Method::GET, "trees", None).await);
    assert_eq!(trees.keys, [key("other/res"), key("svc/kept")]);
    // Cluster keys and other services stay; p1 is no longer anyone's peer.
    assert_eq!(api.peers("svc/kept").await, ["p2"]);
    api.record("other/res").await;
    assert_eq!(api.agents().await, ["p2"]);
    // Unknown (or already torn down) services answer an empty teardown.
    let again: TeardownResponse = typed!(api.ok(Method::DELETE, "services/svc", None).await);
    assert!(again.deleted.is_empty() && again.evicted.is_empty());
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metadata_restart_keeps_agents_peers_and_local_keys() {
    let mut c = Cluster::start().await;
    let api = Api::new(c.metadata_url());
    let v = put_store(&c, "ml/set", Lifespan::Cluster).await;
    api.register_local("ml/local", "p1", "v1", Lifespan::Resource)
        .await;
    api.beat("p1", Some("ml"), &[("ml/local", "v1")]).await;
    api.beat("p2", None, &[("ml/local", "v1"), ("ml/set", &v)])
        .await;
    let before = (api.record("ml/local").await, api.record("ml/set").await);
    api.lease("ml/set", &[], None).await;

    c.restart_metadata().await;
    let after = (api.record("ml/local").await, api.record("ml/set").await);
    assert_eq!(after, before);
    assert_eq!(api.agents().await, ["p1", "p2"]);
    // Leases are not kept: a restart frees every slot.
    assert!(api.leases().await.leases.is_empty());
    // Agents loaded from disk are live (a full TTL to beat again).
    assert_eq!(api.lease("ml/local", &[], None).await.source.id, "p2");
    assert_eq!(api.lease("ml/local", &[], None).await.source.id, "p1");
    c.stop().await;
}

/// The keys the store holds.
async fn store_keys(c: &Cluster) -> Vec<String> {
    let list: TreeList = typed!(Api::new(c.store_url()).ok(Method::GET, "trees", None).await);
    list.keys.into_iter().map(|k| k.to_string()).collect()
}

/// What the store registers for `k`, made conditional: what a retry or the
/// start-up pass sends.
fn late_store_registration(c: &Cluster, version: &str) -> RegisterKey {
    RegisterKey {
        locale: Locale::Store,
        source: c.store_url(),
        holder: None,
        version: version.into(),
        is_dir: true,
        size: 1,
        files: 1,
        tensors: None,
        // Never read from: what matters is whether it is admitted.
        digest: Some(kt_types::Hash([9; 32])),
        options: PutOptions::default(),
        only_if: Some(RegisterIf::AbsentOrHeld),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_put_frees_the_store_copy_and_late_registrations_undo_nothing() {
    let mut c = Cluster::start().await;
    let api = Api::new(c.metadata_url());

    // A local put takes a key over from the store: the store's copy goes.
    let v = put_store(&c, "ml/taken", Lifespan::Cluster).await;
    assert_eq!(store_keys(&c).await, ["ml/taken"]);
    // Not while the metadata server names the store's copy (a put that
    // registered it again wins over a takeover's late deletion).
    let store = Api::new(c.store_url());
    store
        .err(
            Method::DELETE,
            &format!("trees/ml/taken?version={v}&orphaned=true"),
            None,
            ErrorCode::Conflict,
        )
        .await;
    assert_eq!(store_keys(&c).await, ["ml/taken"]);
    api.register_local("ml/taken", "p1", "l1", Lifespan::Cluster)
        .await;
    wait_until("the store drops its copy", WAIT, || async {
        store_keys(&c).await.is_empty()
    })
    .await;
    // A late registration of the store's version does not take it back...
    let late = late_store_registration(&c, &v);
    let msg = api
        .err(
            Method::PUT,
            "keys/ml/taken",
            Some(json!(late)),
            ErrorCode::Conflict,
        )
        .await;
    assert!(msg.contains("held by p1"), "{msg}");
    assert_eq!(api.record("ml/taken").await.holder, "p1");
    // ...nor brings back a deleted key; a new put does.
    let v = put_store(&c, "ml/gone", Lifespan::Cluster).await;
    api.ok(Method::DELETE, "keys/ml/gone", None).await;
    let late = late_store_registration(&c, &v);
    let msg = api
        .err(
            Method::PUT,
            "keys/ml/gone",
            Some(json!(late)),
            ErrorCode::Conflict,
        )
        .await;
    assert!(msg.contains("deleted"), "{msg}");
    put_store(&c, "ml/gone", Lifespan::Cluster).await;
    assert_eq!(api.record("ml/gone").await.holder, "store");

    // While the store is down, one key is taken over by a local put and
    // another is taken over and then deleted. The store, started again,
    // registers neither and removes both copies.
    put_store(&c, "ml/orphan", Lifespan::Cluster).await;
    put_store(&c, "ml/deleted", Lifespan::Cluster).await;
    let addr = c.stop_store().await;
    api.register_local("ml/orphan", "p1", "l1", Lifespan::Cluster)
        .await;
    api.register_local("ml/deleted", "p1", "l1", Lifespan::Cluster)
        .await;
    api.ok(Method::DELETE, "keys/ml/deleted", None).await;
    c.start_store(addr).await;
    assert_eq!(store_keys(&c).await, ["ml/gone"]);
    assert_eq!(api.record("ml/orphan").await.holder, "p1");
    api.err(Method::GET, "keys/ml/deleted", None, ErrorCode::NotFound)
        .await;
    c.stop().await;
}
