//! Lifespans and key ownership as the reference defines them: a key whose
//! first segment names a service is that service's (only it, or admin,
//! writes there) and goes with its teardown unless it was put with
//! `lifespan=cluster`; zero-copy data goes stale when its pod ends.

use std::time::Duration;

use kt_client::{Client, ClientConfig, Progress};
use kt_tests::{Cluster, TOKEN, wait_until, write_files};
use kt_types::api::{AgentList, PutOptions};
use kt_types::auth::{AuthFile, Grant, Role};
use kt_types::{ErrorCode, Key, KeyPrefix, Lifespan};

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

fn lifespan(l: Option<Lifespan>) -> PutOptions {
    PutOptions {
        lifespan: l,
        ..PutOptions::default()
    }
}

/// The keys `ls PREFIX` lists, as the admin sees them.
async fn listed(client: &Client, prefix: &str) -> Vec<String> {
    let prefix = KeyPrefix::parse(prefix).unwrap();
    let mut keys: Vec<String> = client
        .ls(&prefix)
        .await
        .unwrap()
        .entries
        .into_iter()
        .map(|e| e.key)
        .collect();
    keys.sort();
    keys
}

/// Starts agent `id` of service `service` and waits until the metadata
/// server knows it (its heartbeat announced the service).
async fn start_pod(c: &Cluster, id: &str, service: &str) -> kt_tests::Agent {
    let agent = c
        .start_agent_with(id, |cfg| cfg.service = Some(service.into()))
        .await;
    let http = kt_api::client();
    let url = format!("{}/api/v1/agents", c.metadata_url());
    wait_until("the pod's agent announced", Duration::from_secs(30), || {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let Ok(r) = http.get(&url).bearer_auth(TOKEN).send().await else {
                return false;
            };
            let agents: AgentList = r.json().await.unwrap();
            agents
                .agents
                .iter()
                .any(|a| a.id == id && a.service.as_deref() == Some(service))
        }
    })
    .await;
    agent
}

/// The reference's example: `models/final` (cluster) outlives
/// `teardown my-service`; `my-service/temp` (resource) and
/// `my-service/keep` (no lifespan: resource by the rule) go with it, and
/// so does the zero-copy data of the service's pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teardown_deletes_what_the_reference_deletes() {
    let c = Cluster::start().await;
    let pod = start_pod(&c, "my-service-0", "my-service").await;
    let admin = c.client();
    let src = c.dir.path().join("src");
    write_files(&src, &[("checkpoint.pt", b"weights"), ("logs/a", b"log")]);
    let put = |k: &'static str, l: Option<Lifespan>| {
        let (admin, src) = (&admin, &src);
        async move {
            admin
                .put(&key(k), src, lifespan(l), Progress::none())
                .await
                .unwrap()
        }
    };
    put("models/final", Some(Lifespan::Cluster)).await;
    put("my-service/temp", Some(Lifespan::Resource)).await;
    put("my-service/keep", None).await;
    put("my-service/pinned", Some(Lifespan::Cluster)).await;
    // Zero-copy, outside the service's base path, by the service's pod.
    let in_pod = c.client_with(|cfg| cfg.agent_socket = pod.socket().to_owned());
    in_pod
        .put_local(&key("scratch/activations"), &src, lifespan(None))
        .await
        .unwrap();

    let shape = |r: kt_types::KeyRecord| (r.lifespan, r.lifespan_by_rule, r.service);
    let stat = |k: &'static str| {
        let admin = &admin;
        async move { shape(admin.stat(&key(k)).await.unwrap()) }
    };
    assert_eq!(
        stat("my-service/keep").await,
        (Lifespan::Resource, true, "my-service".to_owned())
    );
    assert_eq!(
        stat("models/final").await,
        (Lifespan::Cluster, false, "models".to_owned())
    );
    assert_eq!(
        stat("scratch/activations").await,
        (Lifespan::Resource, true, "scratch".to_owned())
    );

    let torn = admin.teardown("my-service").await.unwrap();
    let mut deleted: Vec<String> = torn.deleted.iter().map(Key::to_string).collect();
    deleted.sort();
    assert_eq!(
        deleted,
        ["my-service/keep", "my-service/temp", "scratch/activations"]
    );
    assert_eq!(torn.evicted, ["my-service-0"]);
    assert_eq!(listed(&admin, "").await, ["models", "my-service"]);
    assert_eq!(listed(&admin, "my-service").await, ["my-service/pinned"]);
    for gone in ["my-service/keep", "my-service/temp", "scratch/activations"] {
        let e = admin.stat(&key(gone)).await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::NotFound), "{gone}: {e}");
    }
    // What stays is still served, byte for byte.
    let dest = c.dir.path().join("final");
    admin
        .get(&key("models/final"), &dest, Progress::none())
        .await
        .unwrap();
    assert_eq!(kt_tests::listing(&dest), kt_tests::listing(&src));
    pod.stop().await;
    c.stop().await;
}

/// Zero-copy data of lifespan `resource` is stale once its pod is gone (and
/// no peer holds it): neither listed nor served; `rm` still deletes it. An
/// explicit `lifespan=cluster` keeps it listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_copy_data_goes_stale_with_its_pod() {
    let c = Cluster::start().await;
    let pod = start_pod(&c, "trainer-0", "trainer").await;
    let admin = c.client();
    let in_pod = c.client_with(|cfg| cfg.agent_socket = pod.socket().to_owned());
    let src = c.dir.path().join("src");
    write_files(&src, &[("shard", b"activations")]);
    in_pod
        .put_local(&key("trainer/shard"), &src, lifespan(None))
        .await
        .unwrap();
    in_pod
        .put_local(
            &key("shared/pinned"),
            &src,
            lifespan(Some(Lifespan::Cluster)),
        )
        .await
        .unwrap();
    assert_eq!(listed(&admin, "trainer").await, ["trainer/shard"]);

    pod.stop().await;
    let admin_ref = &admin;
    wait_until(
        "the pod's zero-copy key to go stale",
        Duration::from_secs(60),
        || async move { listed(admin_ref, "trainer").await.is_empty() },
    )
    .await;
    let e = admin.stat(&key("trainer/shard")).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
    assert!(e.to_string().contains("is stale"), "{e}");
    assert_eq!(listed(&admin, "shared").await, ["shared/pinned"]);
    let rm = admin.rm(&key("trainer/shard"), false).await.unwrap();
    assert_eq!(rm.deleted, [key("trainer/shard")]);
    c.stop().await;
}

const ALPHA: &str = "workload-alpha-0123456789";
const BETA: &str = "workload-beta-01234567890";

/// Under a service's base path only that service (or admin) writes: the
/// issue's case — beta puts `alpha/model/v2`, then alpha is refused its
/// own path — cannot happen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_service_writes_under_its_base_path() {
    let files = tempfile::tempdir().unwrap();
    let grant = |token: &str, service: &str| Grant {
        token: token.into(),
        role: Role::Workload,
        name: None,
        services: Some(vec![service.into()]),
        reads: None,
    };
    let path = files.path().join("auth.json");
    let file = AuthFile {
        tokens: vec![grant(ALPHA, "alpha"), grant(BETA, "beta")],
    };
    std::fs::write(&path, serde_json::to_vec(&file).unwrap()).unwrap();
    let auth = kt_service::Auth::from_file(&path).unwrap();
    let c = Cluster::start_authed(Some(auth), |_| {}).await;
    let as_token = |token: &str| {
        let mut cfg = ClientConfig::new(c.metadata_url(), token);
        cfg.cache_dir = Some(files.path().join(format!("cache-{token}")));
        cfg.agent_socket = files.path().join("no-agent.sock");
        Client::new(cfg).unwrap()
    };
    let (alpha, beta, admin) = (as_token(ALPHA), as_token(BETA), c.client());
    let src = files.path().join("model");
    write_files(&src, &[("w", b"weights")]);
    let put = |client: &Client, k: &str| {
        let (client, k, src) = (client.clone(), key(k), src.clone());
        async move {
            client
                .put(&k, &src, PutOptions::default(), Progress::none())
                .await
        }
    };

    let e = put(&beta, "alpha/model/v2").await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Forbidden), "{e}");
    assert!(
        e.to_string().contains("base path of service \"alpha\""),
        "{e}"
    );
    put(&alpha, "alpha/model/v2").await.unwrap();
    let r = admin.stat(&key("alpha/model/v2")).await.unwrap();
    assert_eq!(
        (r.service.as_str(), r.lifespan),
        ("alpha", Lifespan::Resource)
    );
    // Nor may beta replace or delete it.
    let e = put(&beta, "alpha/model/v2").await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Forbidden), "{e}");
    let e = beta.rm(&key("alpha/model/v2"), false).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Forbidden), "{e}");
    assert!(e.to_string().contains("\"alpha\""), "{e}");
    // Outside every service's base path the putter's own service owns the
    // key, kept until deleted.
    put(&beta, "shared/dataset").await.unwrap();
    let r = admin.stat(&key("shared/dataset")).await.unwrap();
    assert_eq!(
        (r.service.as_str(), r.lifespan),
        ("beta", Lifespan::Cluster)
    );
    // Admin writes anywhere; alpha still owns its path afterwards.
    put(&admin, "alpha/model/v2").await.unwrap();
    put(&alpha, "alpha/model/v2").await.unwrap();
    c.stop().await;
}
