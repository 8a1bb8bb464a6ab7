//! The kind/k3d targets against a mocked command layer: canned outputs for
//! `kind`, `docker` and `kubectl`, assertions on the commands issued and on
//! what happens when something fails.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kt_scenario::format::Signal;
use kt_scenario::live::Live;
use kt_scenario::report::Status;
use kt_scenario::runner::{Options, Runner, scenario_plan};
use kt_scenario::snapshot::{Mode, Snapshots};
use kt_scenario::target::cluster::shell::{Output, Recorder, Shell};
use kt_scenario::target::cluster::{Cluster, ClusterConfig, Session, image_tag};
use kt_scenario::target::kind::Kind;
use kt_scenario::target::{Component, ExecRequest, Program, Target};
use kt_types::env;

const SCENARIO: &str = r#"
description: tiny
topology:
  metadata: { lease_ttl: 2s }
  pods:
    - name: app
      service: train
    - name: getter
      replicas: 2
data:
  small: { seed: 1, files: 2 }
steps:
  - put: { pod: app, key: "{{scenario}}/x", data: small }
  - get: { pod: getter, key: "{{scenario}}/x", verify: [small] }
"#;

const TAG: &str = "0123456789ab";

/// A repository with the kind overlay, and a work root, in a temp dir.
fn layout() -> (tempfile::TempDir, ClusterConfig) {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(repo.join("kustomize/overlays/kind")).unwrap();
    let identity = repo.join("kustomize/components/kube-identity");
    std::fs::create_dir_all(&identity).unwrap();
    std::fs::write(
        identity.join("access.yaml"),
        "rules:\n  - serviceAccount: kt-operator\n    role: admin\n  - serviceAccount: \"*\"\n    role: pod\n",
    )
    .unwrap();
    let vars = |k: &str| (k == env::IMAGE_TAG).then(|| TAG.to_owned());
    let cfg = ClusterConfig::from_env(vars, &repo, &tmp.path().join("work"), false);
    (tmp, cfg)
}

fn loaded(dir: &Path) -> kt_scenario::validate::Loaded {
    let file = dir.join("tiny.yaml");
    std::fs::write(&file, SCENARIO).unwrap();
    kt_scenario::validate::parse(&file, SCENARIO).unwrap_or_else(|d| panic!("{d:?}"))
}

fn position(cmds: &[String], needle: &str) -> usize {
    cmds.iter()
        .position(|c| c.contains(needle))
        .unwrap_or_else(|| panic!("no command with `{needle}` in:\n{}", cmds.join("\n")))
}

const PODS_JSON: &str = r#"{"items": [
  {"metadata": {"name": "getter-1-0"},
   "spec": {"containers": [{"name": "workload"}, {"name": "kt-agent"}]},
   "status": {"containerStatuses": [{"name": "workload", "restartCount": 0},
                                    {"name": "kt-agent", "restartCount": 3}]}},
  {"metadata": {"name": "kt-metadata-7d9f-x2"},
   "spec": {"containers": [{"name": "kt-metadata"}]},
   "status": {"containerStatuses": [{"name": "kt-metadata", "restartCount": 0}]}}
]}"#;

#[tokio::test]
async fn a_failed_rollout_dumps_logs_and_events_then_deletes_the_namespace_and_the_cluster() {
    let (tmp, cfg) = layout();
    let rec = Arc::new(
        Recorder::new()
            .answer(
                "rollout status statefulset/getter-1",
                Output::fail(1, "error: timed out waiting for the condition"),
            )
            .answer("get pods -o json", Output::ok(PODS_JSON))
            .answer(
                "get events",
                Output::ok("LAST SEEN   TYPE      REASON\n1s  Warning  BackOff\n"),
            )
            .prints(
                "svc/kt-metadata",
                &["Forwarding from 127.0.0.1:43081 -> 8081"],
            )
            .prints("svc/kt-store", &["Forwarding from 127.0.0.1:43082 -> 8082"]),
    );
    let session = Arc::new(Session::new(Box::new(Kind), rec.clone(), cfg));
    let l = loaded(tmp.path());
    let report_dir = tmp.path().join("report");
    let runner = Runner::new(
        Options {
            bin_dir: PathBuf::from("/bin-dir"),
            work_root: tmp.path().join("work"),
            report_dir: report_dir.clone(),
            keep: false,
            tags: vec![],
            exclude_tags: vec![],
            python: None,
        },
        Snapshots::new(tmp.path().join("snapshots"), Mode::Check),
        Live::default(),
    );
    let s = session.clone();
    let factory = move || -> Box<dyn Target> { Box::new(Cluster::new(s.clone())) };
    let result = runner.run(std::slice::from_ref(&l), &factory).await;
    session.finish().await.unwrap();

    let scn = &result.scenarios[0];
    assert_eq!(scn.status, Status::Failed, "{scn:?}");
    let msg = scn.message.as_deref().unwrap_or_default();
    assert!(msg.contains("statefulset/getter-1 is not ready"), "{msg}");
    assert!(msg.contains("timed out waiting"), "{msg}");

    let cmds = rec.commands();
    let ns = format!("kt-{}-tiny", runner.run_id);
    // The cluster did not exist: made, its kubeconfig taken, images loaded.
    let create = position(&cmds, "kind create cluster --name kt-scenario --config");
    assert!(cmds[create].contains("testbed/kind/cluster.yaml"));
    let load = position(
        &cmds,
        &format!(
            "kind load docker-image ghcr.io/kt-dev/kt-metadata:{TAG} ghcr.io/kt-dev/kt-store:{TAG} \
             ghcr.io/kt-dev/kt-agent:{TAG} ghcr.io/kt-dev/kt-client:{TAG} \
             ghcr.io/kt-dev/kt-dataset:{TAG} --name kt-scenario"
        ),
    );
    assert!(position(&cmds, "docker image inspect") < create && create < load);
    let apply = position(&cmds, &format!("-n {ns} apply -f"));
    assert!(position(&cmds, &format!("create namespace {ns}")) < apply);
    // Kubernetes identities: no token Secret, the pods' own tokens.
    assert!(
        !cmds.iter().any(|c| c.contains("create secret")),
        "{cmds:?}"
    );
    let failed = position(&cmds, "rollout status statefulset/getter-1");
    assert!(position(&cmds, "rollout status deployment/kt-metadata") < failed);
    // Nothing after the failed rollout but the dump and the teardown.
    assert!(!cmds[failed..].iter().any(|c| c.contains("port-forward")));
    let events = position(&cmds, &format!("-n {ns} get events"));
    let logs = position(&cmds, "logs getter-1-0 -c workload --timestamps");
    let previous = position(&cmds, "logs getter-1-0 -c kt-agent --timestamps --previous");
    position(
        &cmds,
        "logs kt-metadata-7d9f-x2 -c kt-metadata --timestamps",
    );
    assert!(
        !cmds
            .iter()
            .any(|c| c.contains("logs getter-1-0 -c workload --timestamps --previous")),
        "no --previous for a container that never restarted"
    );
    let delete_ns = position(&cmds, &format!("delete namespace {ns} --ignore-not-found"));
    assert!(failed < events && events < delete_ns && logs < delete_ns && previous < delete_ns);
    let delete_cluster = position(&cmds, "kind delete cluster --name kt-scenario");
    assert!(delete_ns < delete_cluster);
    assert_eq!(cmds.len(), delete_cluster + 1, "{}", cmds.join("\n"));

    // The dump holds the events and every container's log.
    let dump = report_dir.join("tiny/logs");
    let ev = std::fs::read_to_string(dump.join("events.txt")).unwrap();
    assert!(ev.contains("BackOff"));
    for f in [
        "getter-1-0.kt-agent.log",
        "getter-1-0.kt-agent.previous.log",
        "getter-1-0.workload.log",
    ] {
        assert!(dump.join(f).is_file(), "{f} missing");
    }
}

/// A target brought up on a pre-existing cluster with canned answers.
async fn up(
    rec: Arc<Recorder>,
    cfg: ClusterConfig,
    tmp: &Path,
) -> (Arc<Session>, Cluster, kt_scenario::target::Plan) {
    let session = Arc::new(Session::new(Box::new(Kind), rec, cfg));
    let mut t = Cluster::new(session.clone());
    let l = loaded(tmp);
    let plan = scenario_plan(
        &l,
        "run1",
        &tmp.join("work/tiny-run1"),
        Path::new("/bin-dir"),
        "tok",
    );
    t.up(&plan).await.unwrap();
    (session, t, plan)
}

/// The token `kubectl create token kt-operator` prints in these tests.
const OPERATOR_TOKEN: &str = "eyJ.operator.sig";

fn forwarding(rec: Recorder) -> Recorder {
    rec.answer(
        "create token kt-operator --audience kt",
        Output::ok(&format!("{OPERATOR_TOKEN}\n")),
    )
    .prints(
        "svc/kt-metadata",
        &["Forwarding from 127.0.0.1:43081 -> 8081"],
    )
    .prints(
        "svc/kt-store",
        &[
            "Handling connection for 8082",
            "Forwarding from 127.0.0.1:43082 -> 8082",
        ],
    )
}

#[tokio::test]
async fn an_existing_cluster_is_used_and_kept() {
    let (tmp, cfg) = layout();
    let rec = Arc::new(forwarding(
        Recorder::new().answer("kind get clusters", Output::ok("other\nkt-scenario\n")),
    ));
    let (session, mut t, plan) = up(rec.clone(), cfg, tmp.path()).await;
    assert_eq!(t.metadata_url(), "http://127.0.0.1:43081");
    assert_eq!(
        t.component_url(&Component::Store).as_deref(),
        Some("http://127.0.0.1:43082")
    );
    assert_eq!(t.component_url(&Component::Pod("app".into())), None);
    assert_eq!(t.namespace(), Some("kt-run1-tiny"));
    let cmds = rec.commands();
    assert!(!cmds.iter().any(|c| c.contains("create cluster")));
    position(&cmds, "kind get kubeconfig --name kt-scenario > ");
    // Every workload is waited for, the scenario's pods included.
    for w in [
        "deployment/kt-metadata",
        "statefulset/kt-store",
        "statefulset/app",
        "statefulset/getter-0",
        "statefulset/getter-1",
    ] {
        position(&cmds, &format!("rollout status {w} --timeout=180s"));
    }
    // The generated kustomization pins the images and points at the overlay.
    let k = std::fs::read_to_string(plan.work_dir.join("deploy/kustomization.yaml")).unwrap();
    assert!(k.contains("namespace: kt-run1-tiny"), "{k}");
    assert!(k.contains("- ../../../repo/kustomize/overlays/kind"), "{k}");
    assert!(
        k.contains("- ../../../repo/kustomize/components/agent-sidecar"),
        "{k}"
    );
    assert!(k.contains(&format!("newTag: {TAG}")), "{k}");
    assert!(k.contains(env::LEASE_TTL), "{k}");
    let pods = std::fs::read_to_string(plan.work_dir.join("deploy/pods.yaml")).unwrap();
    assert!(
        pods.contains("kt.dev/service: train") && pods.contains("kt.dev/service: getter"),
        "{pods}"
    );
    assert_eq!(pods.matches("kt.dev/agent: sidecar").count(), 3, "{pods}");
    // The production path's identities: agent-identity after the sidecar,
    // a ServiceAccount and an access-map rule per pod, no token file, and
    // the runner acting as the operator once the install is up.
    assert!(
        k.contains("- ../../../repo/kustomize/components/agent-identity"),
        "{k}"
    );
    assert!(
        k.contains("behavior: replace") && k.contains("access.yaml"),
        "{k}"
    );
    assert!(k.contains("kt-metadata-tokenreview-kt"), "{k}");
    assert_eq!(pods.matches("kind: ServiceAccount").count(), 3, "{pods}");
    let access = std::fs::read_to_string(plan.work_dir.join("deploy/access.yaml")).unwrap();
    let map: serde_json::Value = serde_yaml_ng::from_str(&access).unwrap();
    let rules = map["rules"].as_array().unwrap();
    let accounts: Vec<&str> = rules
        .iter()
        .map(|r| r["serviceAccount"].as_str().unwrap())
        .collect();
    assert_eq!(
        accounts,
        [
            "kt-operator",
            "scenario-app",
            "scenario-getter-0",
            "scenario-getter-1",
            "*"
        ],
        "{access}"
    );
    // A pod with a service writes it and the scenario's keys; one without
    // writes every service (as the process targets' tokens).
    assert_eq!(rules[1]["services"], serde_json::json!(["train", "tiny"]));
    assert!(rules[2].get("services").is_none(), "{access}");
    assert!(!plan.work_dir.join("deploy/token").exists());
    let token = position(
        &cmds,
        "create token kt-operator --audience kt --duration 24h",
    );
    assert!(position(&cmds, "rollout status statefulset/getter-1") < token);
    assert_eq!(t.operator_token().as_deref(), Some(OPERATOR_TOKEN));

    t.down().await.unwrap();
    let n = rec.commands().len();
    t.down().await.unwrap();
    assert_eq!(rec.commands().len(), n, "a second down does nothing");
    assert!(
        rec.commands()[n - 1]
            .contains("delete namespace kt-run1-tiny --ignore-not-found --wait=false")
    );
    session.finish().await.unwrap();
    assert_eq!(rec.commands().len(), n, "a cluster that existed is kept");
}

#[tokio::test]
async fn steps_exec_in_the_workload_container_with_only_the_requests_token() {
    let (tmp, cfg) = layout();
    let rec = Arc::new(forwarding(Recorder::new().answer(
        "kt get",
        Output {
            status: 4,
            stdout: String::new(),
            stderr: "kt: key not found\ncommand terminated with exit code 4\n".into(),
        },
    )));
    let (_s, t, _plan) = up(rec.clone(), cfg, tmp.path()).await;
    let out = t
        .exec(ExecRequest {
            pod: "getter-1".into(),
            program: Program::Kt,
            args: vec!["get".into(), "a/b".into(), "--dest".into(), "x y".into()],
            env: vec![(env::RELAY_PORT.into(), "9000".into())],
            token: Some("tok".into()),
        })
        .await
        .unwrap();
    assert_eq!(out.status, 4);
    assert_eq!(out.stderr, "kt: key not found\n");
    let last = rec.commands().pop().unwrap();
    assert!(
        last.ends_with(
            "-n kt-run1-tiny exec getter-1-0 -c workload -- env -u KT_TOKEN -u KT_TOKEN_FILE \
             KT_TOKEN=tok KT_RELAY_PORT=9000 kt get a/b --dest 'x y'"
        ),
        "{last}"
    );
    t.exec(ExecRequest {
        pod: "app".into(),
        program: Program::Shell,
        args: vec!["-c".into(), "ls | wc -l".into()],
        env: vec![],
        token: None,
    })
    .await
    .unwrap();
    let last = rec.commands().pop().unwrap();
    assert!(
        last.ends_with(
            "exec app-0 -c workload -- env -u KT_TOKEN -u KT_TOKEN_FILE sh -c -c 'ls | wc -l'"
        ),
        "{last}"
    );
    // The runner's own token: the command keeps the pod's identity.
    t.exec(ExecRequest {
        pod: "app".into(),
        program: Program::Kt,
        args: vec!["ls".into()],
        env: vec![],
        token: Some(OPERATOR_TOKEN.into()),
    })
    .await
    .unwrap();
    let last = rec.commands().pop().unwrap();
    assert!(
        last.ends_with("exec app-0 -c workload -- env -u KT_TOKEN kt ls"),
        "{last}"
    );
    assert!(
        t.exec(ExecRequest {
            pod: "nope".into(),
            program: Program::Kt,
            args: vec![],
            env: vec![],
            token: None
        })
        .await
        .is_err()
    );
}

#[tokio::test]
async fn a_killed_server_stays_down_until_started_on_the_same_port() {
    let (tmp, cfg) = layout();
    let rec = Arc::new(forwarding(Recorder::new().answer(
        "get pods -l app.kubernetes.io/name=kt-store -o name",
        Output::ok("pod/kt-store-0\n"),
    )));
    let (_s, t, _plan) = up(rec.clone(), cfg, tmp.path()).await;
    let before = rec.commands().len();
    t.kill(&Component::Store, Signal::KILL).await.unwrap();
    t.start(&Component::Store).await.unwrap();
    let cmds: Vec<String> = rec.commands()[before..].to_vec();
    let want = [
        "scale statefulset/kt-store --replicas=0",
        "delete pod -l app.kubernetes.io/name=kt-store --grace-period=0 --force --ignore-not-found",
        "get pods -l app.kubernetes.io/name=kt-store -o name",
        "wait --for=delete pod/kt-store-0 --timeout=60s",
        "scale statefulset/kt-store --replicas=1",
        "rollout status statefulset/kt-store --timeout=180s",
        "port-forward --address=127.0.0.1 svc/kt-store 43082:8082 &",
    ];
    assert_eq!(cmds.len(), want.len(), "{}", cmds.join("\n"));
    for (c, w) in cmds.iter().zip(want) {
        assert!(c.ends_with(w), "{c}\n does not end with\n{w}");
    }
    assert_eq!(
        t.component_url(&Component::Store).as_deref(),
        Some("http://127.0.0.1:43082")
    );

    // A pod dies whole with TERM too, gracefully: no forced delete.
    let before = rec.commands().len();
    t.kill(&Component::Pod("getter-0".into()), Signal::TERM)
        .await
        .unwrap();
    let cmds: Vec<String> = rec.commands()[before..].to_vec();
    assert!(cmds[0].ends_with("scale statefulset/getter-0 --replicas=0"));
    assert!(!cmds.iter().any(|c| c.contains("--force")));
    assert!(
        t.kill(&Component::Pod("ghost".into()), Signal::KILL)
            .await
            .is_err()
    );
}

#[tokio::test]
async fn an_agent_is_signalled_from_its_pod_and_waited_for_until_the_kubelet_restarted_it() {
    let (tmp, cfg) = layout();
    let rec = Arc::new(forwarding(
        Recorder::new()
            // Its restart count before, then twice unchanged, then moved.
            .answers(
                "get pod app-0 -o 'jsonpath={.status.initContainerStatuses[?(@.name==\"kt-agent\")].restartCount}'",
                vec![Output::ok("2"), Output::ok("2"), Output::ok("2"), Output::ok("3")],
            ),
    ));
    let (_s, t, _plan) = up(rec.clone(), cfg, tmp.path()).await;
    assert!(!t.keeps_killed_agents_down());
    let before = rec.commands().len();
    t.kill_agent("app", Signal::TERM).await.unwrap();
    t.start(&Component::Pod("app".into())).await.unwrap();
    let cmds: Vec<String> = rec.commands()[before..].to_vec();
    let restarts = cmds.iter().filter(|c| c.contains(".restartCount}")).count();
    assert_eq!(
        restarts,
        4,
        "polled until the count moved:\n{}",
        cmds.join("\n")
    );
    // An ephemeral container as the agent's user signals it (the workload
    // runs as another user).
    let signal = position(&cmds, "debug app-0 --image=ghcr.io/kt-dev/kt-client:");
    for part in [
        "--target=kt-agent",
        "--profile=restricted",
        "--custom=",
        "--container=kt-signal-0",
    ] {
        assert!(cmds[signal].contains(part), "{part} in {}", cmds[signal]);
    }
    assert!(cmds[signal].contains("kt-agent") && cmds[signal].ends_with("signal-agent TERM"));
    assert!(
        cmds.last()
            .unwrap()
            .ends_with("wait --for=condition=Ready pod/app-0 --timeout=180s"),
        "{}",
        cmds.join("\n")
    );
    // Only scenario pods have agents.
    assert!(t.kill_agent("ghost", Signal::KILL).await.is_err());
}

#[tokio::test]
async fn an_agent_the_kubelet_does_not_restart_fails_the_kill_with_the_reason() {
    let (tmp, cfg) = layout();
    let rec = Arc::new(forwarding(
        Recorder::new().answers(".restartCount}", vec![Output::ok("")]),
    ));
    let (_s, t, _plan) = up(rec.clone(), cfg, tmp.path()).await;
    let err = t.kill_agent("app", Signal::KILL).await.unwrap_err();
    assert!(err.to_string().contains("no restart count"), "{err}");
}

#[tokio::test]
async fn pods_readiness_and_agent_metrics_come_from_inside_the_cluster() {
    let (tmp, cfg) = layout();
    let rec = Arc::new(forwarding(
        Recorder::new()
            .answers(
                "get pod getter-0-0 -o 'jsonpath={.status.conditions[?(@.type==\"Ready\")].status}'",
                vec![Output::ok("False"), Output::ok("True")],
            )
            .answer(
                "get pod getter-1-0",
                Output::fail(1, "Error from server (NotFound): pods \"getter-1-0\" not found"),
            )
            .answer("get pod app-0", Output::fail(1, "Unable to connect to the server")),
    ));
    let (_s, t, _plan) = up(rec.clone(), cfg, tmp.path()).await;
    let getter = Component::Pod("getter-0".into());
    assert!(!t.ready(&getter).await.unwrap());
    assert!(t.ready(&getter).await.unwrap());
    // Scaled away: not ready; the API server gone: an error.
    assert!(!t.ready(&Component::Pod("getter-1".into())).await.unwrap());
    assert!(t.ready(&Component::Pod("app".into())).await.is_err());

    let rec = Arc::new(forwarding(Recorder::new().answer(
        "agent-metrics",
        Output::ok(
            "# TYPE kt_process_peak_resident_bytes gauge\nkt_process_peak_resident_bytes 7340032\n",
        ),
    )));
    let (tmp2, cfg2) = layout();
    let (_s, t, _plan) = up(rec.clone(), cfg2, tmp2.path()).await;
    let text = t.metrics(&getter).await.unwrap();
    assert!(text.contains("kt_process_peak_resident_bytes 7340032"));
    let last = rec.commands().pop().unwrap();
    assert!(
        last.contains("exec getter-0-0 -c workload -- sh -c"),
        "{last}"
    );
    assert!(last.contains("Authorization: Bearer $2"), "{last}");
    assert!(
        last.ends_with(&format!("agent-metrics 8090 {OPERATOR_TOKEN}")),
        "{last}"
    );
    assert!(
        t.metrics(&Component::Store).await.is_err(),
        "servers have their URL"
    );
}

#[tokio::test]
async fn data_is_staged_into_the_putting_pods_and_results_fetched_back() {
    let (tmp, cfg) = layout();
    let rec = Arc::new(forwarding(Recorder::new()));
    let (_s, t, plan) = up(rec.clone(), cfg, tmp.path()).await;
    let small = plan.work_dir.join("data/small");
    assert_eq!(
        t.data_path("app", &small).unwrap(),
        "/var/lib/kt/data/data/small"
    );
    assert!(t.data_path("app", Path::new("/etc/passwd")).is_err());
    let w = plan.work_dir.display().to_string();

    let before = rec.commands().len();
    t.stage_data(&[
        ("app".into(), small.clone()),
        ("getter-0".into(), small.clone()),
    ])
    .await
    .unwrap();
    let cmds: Vec<String> = rec.commands()[before..].to_vec();
    assert_eq!(
        cmds.len(),
        3,
        "one pack, one unpack per pod: {}",
        cmds.join("\n")
    );
    assert_eq!(
        cmds[0],
        format!("tar -C {w} -cf {w}/stage/0.tar data/small")
    );
    assert!(
        cmds[1].ends_with(&format!(
            "exec -i app-0 -c workload -- tar -C /var/lib/kt/data -xf - < {w}/stage/0.tar"
        )),
        "{}",
        cmds[1]
    );
    assert!(cmds[2].contains("exec -i getter-0-0 -c workload"));

    let before = rec.commands().len();
    t.fetch("getter-1", Path::new("get/tiny_x")).await.unwrap();
    let cmds: Vec<String> = rec.commands()[before..].to_vec();
    assert!(
        cmds[0].ends_with(&format!(
            "exec getter-1-0 -c workload -- tar -C /var/lib/kt/data -cf - get/tiny_x > {w}/fetch/getter-1.tar"
        )),
        "{}",
        cmds[0]
    );
    assert_eq!(
        cmds[1],
        format!("tar -C {w}/pods/getter-1 -xf {w}/fetch/getter-1.tar")
    );
    assert!(t.fetch("getter-1", Path::new("../escape")).await.is_err());
    assert!(t.fetch("getter-1", Path::new("/abs")).await.is_err());
}

#[tokio::test]
async fn missing_images_stop_before_any_cluster_is_made() {
    let (tmp, cfg) = layout();
    let rec = Arc::new(Recorder::new().answer(
        "docker image inspect",
        Output::fail(1, "Error: No such image"),
    ));
    let session = Arc::new(Session::new(Box::new(Kind), rec.clone(), cfg));
    let mut t = Cluster::new(session.clone());
    let l = loaded(tmp.path());
    let plan = scenario_plan(
        &l,
        "run1",
        &tmp.path().join("work/tiny-run1"),
        Path::new("/b"),
        "tok",
    );
    let e = t.up(&plan).await.unwrap_err().to_string();
    assert!(
        e.contains("make images") && e.contains(env::IMAGE_TAG),
        "{e}"
    );
    t.down().await.unwrap();
    session.finish().await.unwrap();
    assert_eq!(rec.commands().len(), 1, "{:?}", rec.commands());
}

#[tokio::test]
async fn the_image_tag_is_the_git_revision_dirty_or_not() {
    let repo = Path::new("/repo");
    let dirty = Recorder::new()
        .answer("rev-parse --short=12 HEAD", Output::ok("0123456789ab\n"))
        .answer(
            "status --porcelain --untracked-files=no",
            Output::ok(" M Cargo.toml\n"),
        );
    assert_eq!(
        image_tag(&dirty, repo, None).await.unwrap(),
        "0123456789ab-dirty"
    );
    assert_eq!(
        dirty.commands(),
        [
            "git -C /repo rev-parse --short=12 HEAD",
            "git -C /repo status --porcelain --untracked-files=no"
        ]
    );
    let clean = Recorder::new().answer("rev-parse", Output::ok("0123456789ab\n"));
    assert_eq!(image_tag(&clean, repo, None).await.unwrap(), "0123456789ab");
    assert_eq!(image_tag(&clean, repo, Some("v9")).await.unwrap(), "v9");
    let nogit = Recorder::new().answer(
        "rev-parse",
        Output::fail(128, "fatal: not a git repository"),
    );
    let e = image_tag(&nogit, repo, None).await.unwrap_err().to_string();
    assert!(e.contains(env::IMAGE_TAG), "{e}");
}

#[test]
fn unavailable_names_what_is_missing() {
    let (_tmp, cfg) = layout();
    let mut rec = Recorder::new();
    rec.missing = vec!["kind".into(), "docker".into()];
    let rec: Arc<dyn Shell> = Arc::new(rec);
    let s = Arc::new(Session::new(Box::new(Kind), rec.clone(), cfg.clone()));
    assert_eq!(
        Cluster::new(s).unavailable().as_deref(),
        Some("the kind target needs kind, kubectl and docker on PATH (missing: kind, docker)")
    );
    let s = Arc::new(Session::new(
        Box::new(Kind),
        Arc::new(Recorder::new()),
        cfg.clone(),
    ));
    assert_eq!(Cluster::new(s).unavailable(), None);
    let mut moved = cfg;
    moved.kustomize = PathBuf::from("/nowhere/kustomize");
    let s = Arc::new(Session::new(
        Box::new(Kind),
        Arc::new(Recorder::new()),
        moved,
    ));
    let why = Cluster::new(s).unavailable().unwrap();
    assert!(
        why.contains("/nowhere/kustomize/overlays/kind") && why.contains(env::KUSTOMIZE_DIR),
        "{why}"
    );
}

#[tokio::test]
async fn held_commands_run_under_a_reporting_shell_and_are_signalled_by_pid() {
    let (tmp, cfg) = layout();
    let rec = Arc::new(forwarding(
        Recorder::new()
            .prints(
                "kt tensor put",
                &[
                    "kt-scenario-pid 31",
                    "{\"op\":\"tensor-put\"}",
                    "holding a/b (pid 31)",
                    "kt-scenario-exit 0",
                ],
            )
            .answer("getter-1-0 -o 'jsonpath", Output::ok("10.244.0.7")),
    ));
    let (_s, t, _plan) = up(rec.clone(), cfg, tmp.path()).await;
    assert_eq!(t.pod_ip("getter-1").await.unwrap(), "10.244.0.7");
    assert!(
        rec.commands()
            .last()
            .unwrap()
            .ends_with("-n kt-run1-tiny get pod getter-1-0 -o 'jsonpath={.status.podIP}'"),
        "{:?}",
        rec.commands().last()
    );
    let mut p = t
        .spawn(ExecRequest {
            pod: "app".into(),
            program: Program::Kt,
            args: vec!["tensor".into(), "put".into(), "a/b".into(), "--hold".into()],
            env: vec![],
            token: Some("tok".into()),
        })
        .await
        .unwrap();
    let started = rec.commands().last().unwrap().clone();
    assert!(
        started.contains("exec app-0 -c workload -- sh -c")
            && started.ends_with(
                "sh env -u KT_TOKEN -u KT_TOKEN_FILE KT_TOKEN=tok kt tensor put a/b --hold &"
            ),
        "{started}"
    );
    assert_eq!(p.line().await.as_deref(), Some("{\"op\":\"tensor-put\"}"));
    assert_eq!(p.line().await.as_deref(), Some("holding a/b (pid 31)"));
    let out = p.wait().await.unwrap();
    assert_eq!(out.status, 0);
    // Ended: a signal has nothing left to reach.
    let before = rec.commands().len();
    p.signal(Signal::TERM).await.unwrap();
    assert_eq!(rec.commands().len(), before);
    // A pod the cluster gives no address.
    assert!(t.pod_ip("app").await.is_err());
}
