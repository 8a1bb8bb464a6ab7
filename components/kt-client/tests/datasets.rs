//! `kt dataset apply|get|ls|rm` (the binary) against the in-memory API
//! server: what a user types, what they read back, and the errors they get.
//! The controller is not running here: the test writes the status a
//! controller would, through the status subresource.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use kt_kube::apiserver::{ApiServer, ApiServerConfig};
use kt_kube::dataset::{Dataset, DatasetStatus, Phase};
use kt_kube::kube::api::{Api, Patch, PatchParams};
use kt_kube::kube::core::ApiResource;

const NS: &str = "team";

fn kt(kubeconfig: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kt"))
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["--namespace", NS])
        // No kt token or server: dataset commands must not need them.
        .env_remove(kt_types::env::TOKEN)
        .env_remove(kt_types::env::TOKEN_FILE)
        .env_remove("KUBECONFIG")
        .output()
        .expect("run kt")
}

/// [`kt`] off the async threads (the test's API server runs on them).
async fn kt_async(kubeconfig: &Path, args: &[&str]) -> Output {
    let kubeconfig = kubeconfig.to_owned();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    kt_sync::task::spawn(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        kt(&kubeconfig, &args)
    })
    .await
    .expect("kt's thread")
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "kt failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn failed(out: &Output) -> String {
    assert!(
        !out.status.success(),
        "kt succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

async fn server() -> (ApiServer, tempfile::TempDir, std::path::PathBuf) {
    let server = ApiServer::start(ApiServerConfig::default()).await.unwrap();
    server.register_crd(&ApiResource::erase::<Dataset>(&()), true);
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    server.kubeconfig(&kubeconfig).unwrap();
    (server, dir, kubeconfig)
}

/// Writes a status as the controller would.
async fn set_status(server: &ApiServer, name: &str, status: DatasetStatus) {
    let api: Api<Dataset> = Api::namespaced(server.client().unwrap(), NS);
    let body = serde_json::json!({ "status": status });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_get_ls_rm_from_flags_and_manifests() {
    let (server, dir, kc) = server().await;
    let out = kt_async(
        &kc,
        &[
            "dataset",
            "apply",
            "imagenet",
            "--key",
            "team/imagenet",
            "--replicas",
            "8",
            "--node-selector",
            "gpu=a100",
        ],
    )
    .await;
    assert!(ok(&out).contains("dataset imagenet applied (generation 1)"));
    let stored: Dataset = server.get(Some(NS), "imagenet").unwrap().expect("stored");
    assert_eq!(stored.spec.placement.replicas(), 8);
    assert_eq!(stored.spec.placement.node_selector["gpu"], "a100");

    let manifest = dir.path().join("ds.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: kt.dev/v1alpha1\nkind: Dataset\nmetadata: {name: shards}\nspec:\n  source: {s3: {bucket: b, prefix: train/, endpoint: 'http://minio:9000'}}\n  placement: {replicas: 2}\n",
    )
    .unwrap();
    let out = kt_async(&kc, &["dataset", "apply", "-f", manifest.to_str().unwrap()]).await;
    assert!(ok(&out).contains("dataset shards applied"));

    set_status(
        &server,
        "imagenet",
        DatasetStatus {
            phase: Phase::Seeding,
            version: Some("v7".into()),
            ready_nodes: 3,
            observed_generation: Some(1),
            ..Default::default()
        },
    )
    .await;
    let out = kt_async(&kc, &["dataset", "ls"]).await;
    let table = ok(&out);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("NAME"), "{table}");
    assert!(
        lines[1].starts_with("imagenet")
            && lines[1].contains("Seeding")
            && lines[1].contains("3/8")
            && lines[1].contains("v7"),
        "{table}"
    );
    assert!(
        lines[2].starts_with("shards") && lines[2].contains("Pending") && lines[2].contains("0/2"),
        "{table}"
    );

    let out = kt_async(&kc, &["dataset", "get", "imagenet", "-o", "json"]).await;
    let got: Dataset = serde_json::from_str(&ok(&out)).unwrap();
    assert_eq!(got.status.unwrap().version.as_deref(), Some("v7"));

    let out = kt_async(&kc, &["dataset", "rm", "imagenet"]).await;
    assert!(ok(&out).contains("dataset imagenet deleting"));
    assert!(
        server
            .get::<Dataset>(Some(NS), "imagenet")
            .unwrap()
            .is_none()
    );
    let out = kt_async(&kc, &["dataset", "rm", "imagenet"]).await;
    assert!(failed(&out).contains("not found"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_returns_on_ready_and_fails_with_the_reason() {
    let (server, _dir, kc) = server().await;
    let waiter = {
        let kc = kc.clone();
        tokio::spawn(async move {
            kt_async(
                &kc,
                &[
                    "dataset",
                    "apply",
                    "imagenet",
                    "--key",
                    "team/imagenet",
                    "--replicas",
                    "2",
                    "--wait",
                    "Ready",
                    "--timeout",
                    "60s",
                ],
            )
            .await
        })
    };
    // The controller's part: once the Dataset exists, an old generation's
    // Ready must not end the wait; the current one's does.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while server
        .get::<Dataset>(Some(NS), "imagenet")
        .unwrap()
        .is_none()
    {
        assert!(tokio::time::Instant::now() < deadline, "never applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    set_status(
        &server,
        "imagenet",
        DatasetStatus {
            phase: Phase::Ready,
            observed_generation: Some(0),
            ..Default::default()
        },
    )
    .await;
    set_status(
        &server,
        "imagenet",
        DatasetStatus {
            phase: Phase::Seeding,
            observed_generation: Some(1),
            ..Default::default()
        },
    )
    .await;
    assert!(
        !waiter.is_finished(),
        "a status of an older generation ended the wait"
    );
    set_status(
        &server,
        "imagenet",
        DatasetStatus {
            phase: Phase::Ready,
            observed_generation: Some(1),
            ready_nodes: 2,
            version: Some("v1".into()),
            ..Default::default()
        },
    )
    .await;
    let out = waiter.await.expect("the waiting kt");
    assert!(
        ok(&out).contains("imagenet: Ready"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    set_status(
        &server,
        "imagenet",
        DatasetStatus {
            phase: Phase::Failed,
            reason: Some("KeyNotFound".into()),
            observed_generation: Some(1),
            ..Default::default()
        },
    )
    .await;
    let out = kt_async(
        &kc,
        &[
            "dataset",
            "get",
            "imagenet",
            "--wait",
            "Ready",
            "--timeout",
            "30s",
        ],
    )
    .await;
    let err = failed(&out);
    assert!(err.contains("failed: KeyNotFound"), "{err}");

    let out = kt_async(
        &kc,
        &[
            "dataset",
            "get",
            "absent",
            "--wait",
            "Ready",
            "--timeout",
            "1s",
        ],
    )
    .await;
    let err = failed(&out);
    assert!(err.contains("absent"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_before_the_api_server() {
    let (server, dir, kc) = server().await;
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
    )
    .unwrap();
    for (args, want) in [
        (vec!["dataset", "apply", "x"], "needs a source"),
        (
            vec!["dataset", "apply", "x", "--key", "a/b", "--s3", "s3://b"],
            "one source",
        ),
        (vec!["dataset", "apply", "x", "--key", "../etc"], "key"),
        (
            vec!["dataset", "apply", "x", "--key", "a/b", "--replicas", "0"],
            "at least 1",
        ),
        (
            vec!["dataset", "apply", "-f", bad.to_str().unwrap()],
            "not a kt.dev/v1alpha1 Dataset",
        ),
        (vec!["dataset", "get", "x", "--wait", "Done"], "not a phase"),
    ] {
        let out = kt_async(&kc, &args).await;
        let err = failed(&out);
        assert!(err.contains(want), "{args:?}: {err:?} lacks {want:?}");
    }
    assert!(
        server
            .list_values("kt.dev/v1alpha1", "Dataset", Some(NS))
            .unwrap()
            .is_empty()
    );
}
