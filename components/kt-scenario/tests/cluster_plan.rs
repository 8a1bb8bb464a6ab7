//! The plan of the kind and k3d targets (`kt-scenario run --dry-run`) for
//! library scenarios, with a fixed run id, token and image tag: every command
//! in order, and the generated kustomization and StatefulSets. Nothing is
//! executed (not even `kubectl kustomize`), so the snapshots do not depend on
//! the machine or on the kustomize bundle's contents.

use std::path::{Path, PathBuf};

use kt_scenario::target::cluster::{ClusterConfig, Flavor, plan_scenario};
use kt_scenario::target::k3d::K3d;
use kt_scenario::target::kind::Kind;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn plan(flavor: Box<dyn Flavor>, scenario: &str) -> String {
    let l = kt_scenario::validate::load(&repo().join("scenarios").join(scenario))
        .unwrap_or_else(|d| panic!("{d:?}"));
    let tmp = tempfile::tempdir().unwrap();
    // The repository and the work root side by side in one temp dir, so the
    // relative paths of the kustomization are the same on every machine.
    let vars = |k: &str| (k == kt_types::env::IMAGE_TAG).then(|| "0123456789ab".to_owned());
    // kube-identity's access map, which the plan extends (a fixture: the
    // real one's comments and rules are not the plan's business).
    let identity = tmp.path().join("repo/kustomize/components/kube-identity");
    std::fs::create_dir_all(&identity).unwrap();
    std::fs::write(
        identity.join("access.yaml"),
        "rules:\n  - serviceAccount: kt-operator\n    role: admin\n  - serviceAccount: \"*\"\n    role: pod\n    podService: true\n    reads: []\n",
    )
    .unwrap();
    let cfg = ClusterConfig::from_env(
        vars,
        &tmp.path().join("repo"),
        &tmp.path().join("work"),
        false,
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let text = rt.block_on(plan_scenario(
        flavor,
        cfg,
        false,
        &l,
        "run1",
        &tmp.path().join("work"),
        Path::new("/bin-dir"),
        "the-token",
    ));
    text.replace(&tmp.path().display().to_string(), "[tmp]")
}

#[test]
fn kind_plan_of_roundtrip() {
    insta::assert_snapshot!(plan(Box::new(Kind), "roundtrip.yaml"));
}

#[test]
fn kind_plan_of_getters_killed() {
    // Metadata timing knobs and the store's chunk size become env patches.
    insta::assert_snapshot!(plan(Box::new(Kind), "getters-killed.yaml"));
}

#[test]
fn k3d_plan_of_roundtrip() {
    insta::assert_snapshot!(plan(Box::new(K3d), "roundtrip.yaml"));
}

/// Every scenario of the library is planned on both cluster targets without
/// a failing command, or skipped with the reason (`--dry-run` prints the
/// same): none is known to fail there.
#[test]
fn every_library_scenario_is_planned_or_skipped_with_a_reason() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("scenarios"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() > 20, "{files:?}");
    for flavor in ["kind", "k3d"] {
        let mut skipped = Vec::new();
        for f in &files {
            let name = f.file_name().unwrap().to_str().unwrap();
            let plan = plan(
                match flavor {
                    "kind" => Box::new(Kind),
                    _ => Box::new(K3d),
                },
                name,
            );
            assert!(
                !plan.contains("# failed"),
                "{flavor}: {name} has a failing command in its plan:\n{plan}"
            );
            if let Some(line) = plan.lines().find(|l| l.contains(": skipped: ")) {
                skipped.push(line.split(": skipped: ").nth(1).unwrap().to_owned());
                continue;
            }
            assert!(plan.contains("## up") && plan.contains("## down"), "{plan}");
        }
        // What cannot run on a cluster, and only that: the netns-only
        // shaped link, the CUDA scenarios, an agent kept down, Python (the
        // client image has none), frozen processes (kill -STOP), cut
        // links, the dataset scenarios' testbed nodes (topology `nodes`,
        // with `s3` too for dataset-s3) and the runner-side Prometheus of
        // prometheus-broadcast (shard-stream is a Python one), and pods
        // pinned to the testbed's named nodes (tensor-same-node).
        assert_eq!(skipped.len(), 23, "{flavor}: {skipped:#?}");
        assert!(
            skipped
                .iter()
                .all(|why| why.contains(flavor) || why.contains("netns"))
        );
    }
}

#[test]
fn broadcast_200_asks_for_about_one_cpu_of_agent_requests() {
    let text = plan(Box::new(Kind), "broadcast-200.yaml");
    let agents = text
        .matches("cpu: 5m\n        ephemeral-storage: 16Mi\n        memory: 16Mi")
        .count();
    assert_eq!(agents, 201, "every pod's agent asks for 5m and 16Mi");
}
