//! `--kube-auth` end to end, against a scripted Kubernetes API: the
//! metadata server reviews ServiceAccount tokens (TokenReview, then the pod
//! a token is bound to) and maps them with an access map; the store and an
//! agent ask the metadata server. A pod acts as its own agent and writes
//! only its service; a token of another audience, a gone or recreated pod,
//! another namespace, are refused with why; answers are cached.

use std::sync::Arc;
use std::time::Duration;

use kt_kube::mock::{self, MockApi, Reply};
use kt_service::auth::AskMetadata;
use kt_service::{Auth, Token};
use kt_types::ErrorCode;
use kt_types::auth::AccessMap;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const REVIEWS: &str = "apis/authentication.k8s.io/v1/tokenreviews";

/// The API server's side: who each token is.
fn token_review(body: &[u8]) -> Reply {
    let asked: Value = serde_json::from_slice(body).unwrap_or_default();
    let token = asked["spec"]["token"].as_str().unwrap_or_default();
    assert_eq!(asked["spec"]["audiences"], json!(["kt"]), "kt's audience");
    let sa = |ns: &str, name: &str, pod: Option<(&str, &str)>| {
        let mut user = json!({"username": format!("system:serviceaccount:{ns}:{name}")});
        if let Some((pod, uid)) = pod {
            user["extra"] = json!({
                "authentication.kubernetes.io/pod-name": [pod],
                "authentication.kubernetes.io/pod-uid": [uid],
            });
        }
        json!({"authenticated": true, "user": user, "audiences": ["kt"]})
    };
    let status = match token {
        "h.tok-metadata.s" => sa("kt", "kt-metadata", None),
        "h.tok-store.s" => sa("kt", "kt-store", Some(("kt-store-0", "u-s"))),
        "h.tok-pod-a.s" => sa("kt", "trainer", Some(("pod-a", "u-a"))),
        "h.tok-pod-b.s" => sa("kt", "default", Some(("pod-b", "u-b"))),
        "h.tok-recreated.s" => sa("kt", "default", Some(("pod-c", "u-old"))),
        "h.tok-gone.s" => sa("kt", "default", Some(("pod-d", "u-d"))),
        "h.tok-other-ns.s" => sa("prod", "default", Some(("pod-e", "u-e"))),
        "h.tok-unbound.s" => sa("kt", "default", None),
        "h.tok-user.s" => json!({"authenticated": true, "user": {"username": "alice"}}),
        "h.tok-api-down.s" => return mock::status(500, "etcd is away"),
        _ => json!({"authenticated": false, "error": "[invalid bearer token]"}),
    };
    Reply::Json(
        http::StatusCode::CREATED,
        json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
               "metadata": {}, "spec": {}, "status": status}),
    )
}

fn pod(name: &str, uid: &str, ip: &str, service: &str) -> Reply {
    Reply::Json(
        http::StatusCode::OK,
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": "kt", "uid": uid,
                            "labels": {kt_kube::SERVICE_LABEL: service}},
               "status": {"phase": "Running", "podIP": ip}}),
    )
}

fn api() -> MockApi {
    let api = MockApi::default();
    api.respond(REVIEWS, token_review);
    let pods = [
        ("pod-a", "u-a", "127.0.0.1", "train"),
        ("pod-b", "u-b", "127.0.0.2", "eval"),
        ("pod-c", "u-new", "127.0.0.3", "eval"),
        ("kt-store-0", "u-s", "127.0.0.4", ""),
    ];
    for (name, uid, ip, service) in pods {
        api.respond(&format!("pods/{name}"), move |_| {
            pod(name, uid, ip, service)
        });
    }
    api.respond("pods/pod-d", |_| {
        mock::status(404, "pods \"pod-d\" not found")
    });
    api
}

const ACCESS: &str = r#"
rules:
  - serviceAccount: kt-metadata
    role: admin
  - serviceAccount: kt-store
    role: store
  - serviceAccount: "*"
    role: pod
    podService: true
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_account_tokens_are_reviewed_and_mapped() {
    let dir = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let mock = api();
    let (client, _served) = mock.client("kt");
    let map_path = dir.path().join("access.yaml");
    std::fs::write(&map_path, ACCESS).unwrap();
    let map: AccessMap = kt_metadata::kube_auth::load_access_map(&map_path).unwrap();
    let reviewer = kt_metadata::kube_auth::KubeReviewer::new(client, "kt", "kt", map);

    let meta_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let meta_url = format!("http://{}", meta_l.local_addr().unwrap());
    let mut meta = kt_metadata::Config::new(
        dir.path().join("meta"),
        Token::new("h.tok-metadata.s").unwrap(),
    );
    meta.server.auth = Some(Auth::none().with_reviewer(Arc::new(reviewer)));
    let s = stop.clone();
    let meta_task = tokio::spawn(async move { kt_metadata::run(meta_l, meta, s).await });

    // The store and the agent of pod-a ask the metadata server.
    let asking = |token: &str| {
        let ask = AskMetadata::new(&meta_url, kt_api::Credential::fixed(token)).unwrap();
        Some(Auth::none().with_reviewer(Arc::new(ask)))
    };
    let store_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut store = kt_store::Config::new(
        dir.path().join("store"),
        meta_url.clone(),
        Token::new("h.tok-store.s").unwrap(),
    );
    store.server.auth = asking("h.tok-store.s");
    let store = kt_store::start(store_l, store, stop.clone()).unwrap();
    let agent_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut agent = kt_agent::Config::new(
        "pod-a",
        meta_url.clone(),
        Token::new("h.tok-pod-a.s").unwrap(),
        dir.path().join("agent/agent.sock"),
    );
    agent.server.auth = asking("h.tok-pod-a.s");
    agent.shm_dir = dir.path().join("shm");
    std::fs::create_dir_all(&agent.shm_dir).unwrap();
    let agent = kt_agent::start(agent_l, agent, stop.clone()).unwrap();

    let http = kt_api::client();
    let call = |method: &str, path: &str, token: &str, body: Option<Value>| {
        let mut r = http
            .request(
                reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
                format!("{meta_url}{path}"),
            )
            .bearer_auth(token)
            .timeout(Duration::from_secs(10));
        if let Some(b) = body {
            r = r.json(&b);
        }
        async move {
            let resp = r.send().await.unwrap();
            let status = resp.status().as_u16();
            (status, resp.text().await.unwrap_or_default())
        }
    };

    // The store registered with its ServiceAccount's token, and pod-a's
    // agent announced itself on its pod's IP.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (store, _) = call("GET", "/api/v1/store", "h.tok-pod-a.s", None).await;
        let (_, agents) = call("GET", "/api/v1/agents", "h.tok-metadata.s", None).await;
        if store == 200 && agents.contains("pod-a") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "store {store}, agents {agents}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A pod puts into its own service through the store (which asks who
    // it is), and nowhere else.
    let src = dir.path().join("w.bin");
    std::fs::write(&src, b"weights").unwrap();
    let put = |token: &'static str, key: &'static str, service: Option<&'static str>| {
        kt_tests::put_as(&meta_url, dir.path(), token, key, &src, service)
    };
    assert_eq!(put("h.tok-pod-a.s", "train/w", None).await, Ok(()));
    assert_eq!(
        put("h.tok-pod-a.s", "eval/w", Some("eval")).await,
        Err(Some(ErrorCode::Forbidden))
    );

    // Pod b (service eval) cannot hijack the store, act as pod-a's agent,
    // announce itself on pod-a's IP, or touch train's keys.
    let beat = |id: &str, ip: &str| json!({"id": id, "url": format!("http://{ip}:8090")});
    for (method, path, body) in [
        (
            "POST",
            "/api/v1/stores",
            Some(json!({"url": "http://127.0.0.2:1"})),
        ),
        ("POST", "/api/v1/agents", Some(beat("pod-a", "127.0.0.1"))),
        ("POST", "/api/v1/agents", Some(beat("pod-b", "127.0.0.1"))),
        ("DELETE", "/api/v1/keys/train/w", None),
        ("DELETE", "/api/v1/services/train", None),
    ] {
        let (status, text) = call(method, path, "h.tok-pod-b.s", body).await;
        assert_eq!(status, 403, "{method} {path}: {text}");
    }
    let (status, text) = call(
        "POST",
        "/api/v1/agents",
        "h.tok-pod-b.s",
        Some(beat("pod-b", "127.0.0.2")),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let (status, _) = call("GET", "/api/v1/keys/train/w", "h.tok-pod-b.s", None).await;
    assert_eq!(status, 200, "train/w is still there");

    // Refused, with why: the caller learns what to fix.
    for (token, why) in [
        ("h.tok-recreated.s", "earlier pod"),
        ("h.tok-gone.s", "is gone"),
        ("h.tok-other-ns.s", "no rule"),
        ("h.tok-unbound.s", "bound to no pod"),
        ("h.tok-user.s", "not a ServiceAccount"),
        ("forged", "invalid bearer token"),
    ] {
        let (status, text) = call("GET", "/api/v1/store", token, None).await;
        assert_eq!(status, 401, "{token}: {text}");
        assert!(text.contains(why), "{token}: {text}");
    }
    // A token that is not a JWT costs the API server no review.
    let reviews = mock.count(REVIEWS);
    for i in 0..100 {
        let (status, _) = call("GET", "/api/v1/store", &format!("made-up-{i}"), None).await;
        assert_eq!(status, 401);
    }
    assert_eq!(
        mock.count(REVIEWS),
        reviews,
        "made-up tokens are not reviewed"
    );
    // The API away is not the caller's fault: 503, and nothing cached.
    let (status, text) = call("GET", "/api/v1/store", "h.tok-api-down.s", None).await;
    assert_eq!(status, 503, "{text}");

    // Answers are kept: pod b's token is not reviewed again.
    let reviews = mock.count(REVIEWS);
    for _ in 0..3 {
        assert_eq!(
            call("GET", "/api/v1/store", "h.tok-pod-b.s", None).await.0,
            200
        );
        assert_eq!(call("GET", "/api/v1/store", "forged", None).await.0, 401);
    }
    assert_eq!(mock.count(REVIEWS), reviews, "cached answers");
    assert_eq!(
        call("GET", "/api/v1/store", "h.tok-api-down.s", None)
            .await
            .0,
        503
    );
    assert_eq!(mock.count(REVIEWS), reviews + 1, "a failure is asked again");

    // Pod a tears its own service down.
    let (status, text) = call("DELETE", "/api/v1/services/train", "h.tok-pod-a.s", None).await;
    assert_eq!(status, 200, "{text}");

    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), store.task).await;
    let _ = tokio::time::timeout(Duration::from_secs(15), agent.task).await;
    let _ = tokio::time::timeout(Duration::from_secs(15), meta_task).await;
}
