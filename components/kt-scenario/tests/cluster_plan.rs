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
    let vars = |k: &str| (k == "KT_IMAGE_TAG").then(|| "0123456789ab".to_owned());
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
