//! External access against a scripted API server: the token Secret, the
//! Ready pod behind a Service and its container port, pods by IP, and the
//! local URLs. (The port-forward itself is a WebSocket upgrade the mock
//! cannot answer; see the crate's report.)

use http::StatusCode;
use kt_kube::mock::{self, MockApi, Reply};
use kt_kube::portforward::{self, ForwardError, Forwarder, Target};
use serde_json::{Value, json};

fn ok(body: Value) -> Reply {
    Reply::Json(StatusCode::OK, body)
}

fn service(name: &str, port: u16, target_port: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "kt", "resourceVersion": "1"},
        "spec": {
            "selector": {"app.kubernetes.io/name": name},
            "ports": [{"name": "http", "port": port, "targetPort": target_port}],
        },
    })
}

fn server_pod(name: &str, ready: bool, deleting: bool) -> Value {
    let mut p = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "kt", "resourceVersion": "1"},
        "spec": {"containers": [{
            "name": "server",
            "ports": [{"name": "http", "containerPort": 18081}],
        }]},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        },
    });
    if deleting {
        p["metadata"]["deletionTimestamp"] = json!("2026-11-22T00:00:00Z");
    }
    p
}

#[tokio::test]
async fn reads_the_token_secret() {
    let api = MockApi::default();
    api.script(
        "secrets/kt-token",
        ok(json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "kt-token", "namespace": "kt"},
            // "s3cret\n"
            "data": {"token": "czNjcmV0Cg=="},
        })),
    );
    api.script(
        "secrets/kt-token",
        ok(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "kt-token"}, "data": {}})),
    );
    api.script("secrets/kt-token", mock::status(403, "forbidden"));
    let (client, task) = api.client("kt");
    let token = portforward::read_token(&client, "kt", "kt-token", "token").await;
    assert_eq!(token.expect("token"), "s3cret");
    let missing = portforward::read_token(&client, "kt", "kt-token", "token").await;
    assert!(
        matches!(&missing, Err(ForwardError::NotFound(m)) if m.contains("no key \"token\"")),
        "{missing:?}"
    );
    let denied = portforward::read_token(&client, "kt", "kt-token", "token").await;
    assert!(
        matches!(&denied, Err(e @ ForwardError::Kube { .. }) if e.to_string().contains("reading Secret kt/kt-token")),
        "{denied:?}"
    );
    task.abort();
}

#[tokio::test]
async fn without_a_token_secret_kt_requests_an_operator_token() {
    let api = MockApi::default();
    // Kubernetes identities: no Secret (or no right to read it), a token
    // for kt-operator instead; the static Secret wins where it exists.
    api.script("secrets/kt-token", mock::status(404, "not found"));
    api.script("secrets/kt-token", mock::status(403, "forbidden"));
    for _ in 0..2 {
        api.script(
            "serviceaccounts/kt-operator/token",
            ok(json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                      "metadata": {}, "spec": {"audiences": ["kt"]},
                      "status": {"token": "projected.jwt", "expirationTimestamp": "2030-01-01T00:00:00Z"}})),
        );
    }
    api.script("secrets/kt-token", mock::status(500, "etcd away"));
    let (client, task) = api.client("kt");
    for _ in 0..2 {
        let t = portforward::cluster_token(&client, "kt").await;
        assert_eq!(t.expect("token"), "projected.jwt");
    }
    let away = portforward::cluster_token(&client, "kt").await;
    assert!(matches!(away, Err(ForwardError::Kube { .. })), "{away:?}");
    assert_eq!(api.count("serviceaccounts/kt-operator/token"), 2);
    task.abort();
}

#[tokio::test]
async fn picks_a_ready_pod_by_the_services_selector_and_resolves_the_port() {
    let api = MockApi::default();
    api.script(
        "services/kt-metadata",
        ok(service("kt-metadata", 8081, json!("http"))),
    );
    api.script(
        "pods",
        ok(mock::list(
            &[
                server_pod("kt-metadata-a", false, false),
                server_pod("kt-metadata-b", true, true),
                server_pod("kt-metadata-c", true, false),
            ],
            "2",
        )),
    );
    // A Service with a numeric target port, and no Ready pod.
    api.script(
        "services/kt-store",
        ok(service("kt-store", 8082, json!(9000))),
    );
    api.script(
        "pods",
        ok(mock::list(&[server_pod("kt-store-0", false, false)], "2")),
    );
    let (client, task) = api.client("kt");

    let (pod, port) = portforward::service_target(&client, "kt", "kt-metadata", 8081)
        .await
        .expect("target");
    assert_eq!(
        (pod.as_str(), port),
        ("kt-metadata-c", 18081),
        "the Ready pod not being deleted"
    );
    let list = api
        .seen()
        .into_iter()
        .find(|s| s.contains(" pods "))
        .unwrap_or_default();
    assert!(
        list.contains("labelSelector=app.kubernetes.io%2Fname%3Dkt-metadata"),
        "pods listed by the Service's selector: {list}"
    );

    let none = portforward::service_target(&client, "kt", "kt-store", 8082).await;
    assert!(
        matches!(&none, Err(ForwardError::NotFound(m)) if m.contains("no Ready pod behind Service kt/kt-store")),
        "{none:?}"
    );
    task.abort();
}

#[tokio::test]
async fn finds_agents_pods_by_ip() {
    let api = MockApi::default();
    api.script(
        "pods",
        ok(mock::list(
            &[mock::pod("train-x", "train", "Running", "1")],
            "2",
        )),
    );
    api.script("pods", ok(mock::list(&[], "2")));
    let (client, task) = api.client("kt");
    let ip = "10.1.2.3".parse().expect("ip");
    let pod = portforward::pod_by_ip(&client, "kt", ip)
        .await
        .expect("pod");
    assert_eq!(pod, "train-x");
    assert!(
        api.seen()
            .iter()
            .any(|s| s.contains("fieldSelector=status.podIP%3D10.1.2.3")),
        "{:?}",
        api.seen()
    );
    let none = portforward::pod_by_ip(&client, "kt", ip).await;
    assert!(matches!(none, Err(ForwardError::NotFound(_))), "{none:?}");
    task.abort();
}

#[tokio::test]
async fn maps_cluster_urls_to_stable_local_listeners() {
    let api = MockApi::default();
    api.script(
        "services/kt-store",
        ok(service("kt-store", 8082, json!("http"))),
    );
    api.script(
        "pods",
        ok(mock::list(&[server_pod("kt-store-0", true, false)], "2")),
    );
    let (client, task) = api.client("kt");
    let fwd = Forwarder::new(client, "kt");
    let store = fwd
        .local_url("http://kt-store:8082/api/v1/puts")
        .expect("store");
    assert!(store.starts_with("http://127.0.0.1:"), "{store}");
    assert!(store.ends_with("/api/v1/puts"), "{store}");
    let again = fwd
        .local_url("http://kt-store.kt.svc.cluster.local:8082")
        .expect("store");
    assert_eq!(
        store.trim_end_matches("/api/v1/puts"),
        again,
        "one listener per target"
    );
    // An https:// server (the tls component) keeps its scheme, on the same
    // listener: the forward carries bytes, TLS is end to end.
    let tls = fwd.local_url("https://kt-store:8082/x").expect("store");
    assert_eq!(tls, format!("https{}/x", again.trim_start_matches("http")));
    let meta = fwd.local_url("http://kt-metadata:8081").expect("metadata");
    let agent = fwd.local_url("http://10.1.2.3:8090").expect("agent");
    assert_ne!(meta, again);
    assert_ne!(agent, meta);
    let elsewhere = fwd.local_url("http://kt-store.other:8082");
    assert!(
        matches!(elsewhere, Err(ForwardError::Unsupported(_))),
        "{elsewhere:?}"
    );
    // The listener's target resolves through the API (once).
    let route = (Target::Service("kt-store".into()), 8082);
    assert_eq!(
        fwd.resolve(&route).await.expect("resolved"),
        ("kt-store-0".into(), 18081)
    );
    fwd.close().await;
    task.abort();
}
