//! The sidecar injector over HTTPS, in process: a CA made for the test
//! (as cert-manager's would be), the webhook on 127.0.0.1:0 with the
//! committed template, and AdmissionReviews as the API server sends them.
//! The patch it answers, applied to the pod (by the json-patch crate, an
//! implementation of RFC 6902 that is not ours), gives the pod template
//! kustomize renders for the same workload with agent-sidecar and
//! agent-identity (`manifests/examples/trainer.yaml`).
#![cfg(feature = "kube")]

use std::path::PathBuf;
use std::sync::Arc;

use base64::Engine;
use kt_kube::inject::Template;
use kt_metadata::webhook::{MAX_BODY, MAX_IN_FLIGHT, Webhook, WebhookArgs};
use kt_service::Metrics;
use kt_service::tls::Tls;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use kt_kube::mock::{repo_docs as docs, repo_file as read, repo_root as root};

const TEMPLATE: &str = "kustomize/components/sidecar-injector/template.yaml";

fn agent_image() -> String {
    read("kustomize/components/sidecar-injector/agent-image.env")
        .lines()
        .find_map(|l| l.strip_prefix("agent-image="))
        .expect("agent-image=")
        .to_owned()
}

/// A CA and a certificate for 127.0.0.1 signed by it.
struct Pki {
    dir: tempfile::TempDir,
    ca: String,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "kt-sidecar-injector test CA");
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let ca = ca.self_signed(&ca_key).unwrap();
        let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
        std::fs::write(dir.path().join("tls.crt"), cert.pem()).unwrap();
        std::fs::write(dir.path().join("tls.key"), key.serialize_pem()).unwrap();
        Pki { dir, ca: ca.pem() }
    }

    fn cert(&self) -> PathBuf {
        self.dir.path().join("tls.crt")
    }

    fn key(&self) -> PathBuf {
        self.dir.path().join("tls.key")
    }
}

struct Running {
    url: String,
    client: reqwest::Client,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    _pki: Pki,
}

async fn start() -> Running {
    let pki = Pki::new();
    let hook = WebhookArgs {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        tls_cert: Some(pki.cert()),
        tls_key: Some(pki.key()),
        template: Some(root().join(TEMPLATE)),
        agent_image: Some(agent_image()),
    }
    .load()
    .unwrap()
    .unwrap()
    .1;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics = Arc::new(Metrics::new());
    let stop = CancellationToken::new();
    let task = tokio::spawn(hook.serve(listener, metrics.clone(), stop.clone()));
    let client = kt_api::client_builder()
        .use_rustls_tls()
        .add_root_certificate(reqwest::Certificate::from_pem(pki.ca.as_bytes()).unwrap())
        .build()
        .unwrap();
    Running {
        url: format!("https://{addr}/mutate"),
        client,
        metrics,
        stop,
        task,
        _pki: pki,
    }
}

impl Running {
    async fn post(&self, body: Vec<u8>) -> (u16, Value) {
        let resp = self
            .client
            .post(&self.url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap().unwrap();
    }
}

fn review(uid: &str, kind: Value, object: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": kind,
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": kind,
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": "kt",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": object,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    }))
    .unwrap()
}

fn pod_kind() -> Value {
    json!({"group": "", "version": "v1", "kind": "Pod"})
}

fn decode_patch(response: &Value) -> json_patch::Patch {
    let b64 = response["patch"].as_str().expect("a patch");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

#[tokio::test]
async fn a_pod_admitted_through_the_webhook_is_the_pod_kustomize_renders() {
    let hook = start().await;
    let rendered = docs("manifests/examples/trainer.yaml");
    let source = &docs("kustomize/examples/trainer/deployment.yaml")[0];
    let tpl = &source["spec"]["template"];
    // The pod as the ReplicaSet controller creates it.
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "trainer-6d4cf56db6-",
            "namespace": "kt",
            "labels": tpl["metadata"]["labels"],
        },
        "spec": tpl["spec"],
    });
    let (status, answer) = hook.post(review("a1b2", pod_kind(), pod.clone())).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["kind"], "AdmissionReview");
    let response = &answer["response"];
    assert_eq!(response["uid"], "a1b2");
    assert_eq!(response["allowed"], true);
    assert_eq!(response["patchType"], "JSONPatch");
    let mut injected = pod.clone();
    json_patch::patch(&mut injected, &decode_patch(response)).unwrap();
    let want = rendered
        .iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "trainer")
        .unwrap();
    assert_eq!(injected["spec"], want["spec"]["template"]["spec"]);
    assert_eq!(
        injected["metadata"]["annotations"],
        want["spec"]["template"]["metadata"]["annotations"]
    );

    // The injected pod again (a reinvocation): allowed, nothing to patch.
    let (status, answer) = hook.post(review("c3", pod_kind(), injected)).await;
    assert_eq!(status, 200);
    assert_eq!(answer["response"], json!({"uid": "c3", "allowed": true}));
    hook.stop().await;
}

#[tokio::test]
async fn what_it_cannot_answer_is_a_400_and_what_it_does_not_handle_is_allowed() {
    let hook = start().await;
    // Not a review: 400 with kt's error body (the API server then applies
    // the webhook's failurePolicy).
    let (status, body) = hook.post(b"{\"kind\": \"Pod\"".to_vec()).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "invalid_request");
    // A pod that cannot be injected.
    let (status, body) = hook
        .post(review("u", pod_kind(), json!({"metadata": {"name": "p"}})))
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("kt/p: not a pod"),
        "{body}"
    );
    // Not a pod: allowed as it is.
    let cm = json!({"group": "", "version": "v1", "kind": "ConfigMap"});
    let (status, body) = hook.post(review("v", cm, json!({}))).await;
    assert_eq!(status, 200);
    assert_eq!(body["response"], json!({"uid": "v", "allowed": true}));
    // Too large.
    let (status, body) = hook.post(vec![b' '; MAX_BODY + 1]).await;
    assert_eq!(status, 413, "{body}");
    // Another path, another method.
    let resp = hook.client.get(&hook.url).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 405);
    let text = hook.metrics.encode();
    assert!(
        text.contains(r#"kt_http_requests_total{method="POST",route="/mutate",status="200"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kt_http_requests_total{method="POST",route="/mutate",status="400"} 2"#),
        "{text}"
    );
    hook.stop().await;
}

/// Review B5: peers that open reviews and stall their bodies, as many as
/// there are slots, hold none for long: each body that sends nothing for
/// `BODY_IDLE` fails, and the API server's review is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_hold_no_slot_for_long() {
    use futures::StreamExt;
    let hook = start().await;
    let stalled: Vec<_> = (0..MAX_IN_FLIGHT)
        .map(|_| {
            let body = futures::stream::once(async {
                Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"{"))
            })
            .chain(futures::stream::pending());
            let req = hook
                .client
                .post(&hook.url)
                .header("content-type", "application/json")
                .body(reqwest::Body::wrap_stream(body))
                .send();
            tokio::spawn(async move {
                let resp = req.await.unwrap();
                (
                    resp.status().as_u16(),
                    resp.text().await.unwrap_or_default(),
                )
            })
        })
        .collect();
    let cm = json!({"group": "", "version": "v1", "kind": "ConfigMap"});
    let (status, body) = hook.post(review("after", cm, json!({}))).await;
    assert_eq!(status, 200, "{body}");
    for s in stalled {
        let (status, text) = s.await.unwrap();
        assert_eq!(status, 400, "{text}");
        assert!(
            text.contains("sent nothing"),
            "failed for its idle body: {text}"
        );
    }
    hook.stop().await;
}

#[test]
fn the_webhook_flags_go_together() {
    let pki = Pki::new();
    let full = WebhookArgs {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        tls_cert: Some(pki.cert()),
        tls_key: Some(pki.key()),
        template: Some(root().join(TEMPLATE)),
        agent_image: Some(agent_image()),
    };
    assert!(WebhookArgs::default().load().unwrap().is_none());
    let err = |a: WebhookArgs| a.load().map(|_| ()).unwrap_err();
    assert!(
        err(WebhookArgs {
            listen: None,
            ..full.clone()
        })
        .contains("without --webhook-listen")
    );
    assert!(
        err(WebhookArgs {
            tls_key: None,
            ..full.clone()
        })
        .contains("--webhook-tls-key")
    );
    assert!(
        err(WebhookArgs {
            agent_image: None,
            ..full.clone()
        })
        .contains("--inject-agent-image")
    );
    assert!(
        err(WebhookArgs {
            template: Some(root().join("Cargo.toml")),
            ..full.clone()
        })
        .contains("--inject-template")
    );
    // The template with the image, as Webhook::new takes it.
    let t = Template::from_yaml(&read(TEMPLATE))
        .unwrap()
        .with_agent_image("a");
    let _ = Webhook::new(t, Tls::load(&pki.cert(), &pki.key()).unwrap());
}
