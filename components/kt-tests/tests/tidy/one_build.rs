//! One feature set per dependency: every package selection the Makefile
//! builds resolves each dependency to the features of the whole workspace's
//! test build, so no target compiles a dependency (and everything above it)
//! again with other features. `components/kt-workspace-hack` holds the
//! union; this names the package and features when it drifts.

use std::collections::{BTreeMap, BTreeSet};

use super::root;

/// `cargo tree` of one selection: each package (not a workspace member) with
/// the feature sets it resolves to (a package built for build scripts and
/// for the target may show two).
fn resolved(args: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
    tree(args, false)
}

/// The workspace members of one selection, with their features.
fn members(args: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
    tree(args, true)
}

fn tree(args: &[&str], members: bool) -> BTreeMap<String, BTreeSet<String>> {
    let out = std::process::Command::new(env!("CARGO"))
        .args(["tree", "--offline", "--prefix", "none", "-f", "{p}|{f}"])
        .args(args)
        .current_dir(root())
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut packages = BTreeMap::<String, BTreeSet<String>>::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((package, features)) = line.split_once('|') else {
            continue;
        };
        // "name v1.2.3 (path)": members have a path; "(*)" marks a repeat.
        let mut words = package.split_whitespace();
        let (Some(name), Some(version)) = (words.next(), words.next()) else {
            continue;
        };
        if package.contains("(/") != members {
            continue;
        }
        let features = features.trim_end_matches(" (*)").trim().to_owned();
        packages
            .entry(format!("{name} {version}"))
            .or_default()
            .insert(features);
    }
    packages
}

/// Each package of `selection` that resolves to a feature set the reference
/// never does.
fn drift(
    reference: &BTreeMap<String, BTreeSet<String>>,
    selection: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let mut broken = Vec::new();
    for (package, sets) in selection {
        let known = reference.get(package);
        for set in sets {
            if !known.is_some_and(|k| k.contains(set)) {
                broken.push(format!(
                    "{package}: [{set}] here, [{}] in the test build",
                    known
                        .map(|k| k.iter().cloned().collect::<Vec<_>>().join("] or ["))
                        .unwrap_or_default()
                ));
            }
        }
    }
    broken
}

/// The Makefile's `RELEASE_PKGS` (the release binaries' selection).
fn release_packages() -> Vec<String> {
    let makefile = std::fs::read_to_string(root().join("Makefile")).unwrap();
    let line = makefile
        .lines()
        .find_map(|l| l.strip_prefix("RELEASE_PKGS := "))
        .expect("the Makefile defines RELEASE_PKGS");
    line.split_whitespace().map(str::to_owned).collect()
}

#[test]
fn every_build_resolves_one_feature_set_per_dependency() {
    // The test build (`make test`'s DEV_BUILD and nextest): the reference.
    let reference = resolved(&["--workspace"]);
    let release = release_packages();
    let release: Vec<&str> = release.iter().map(String::as_str).collect();
    let with_bench = [&release[..], &["-p", "kt-bench"]].concat();
    let selections: [(&str, Vec<&str>); 5] = [
        (
            "the workspace's binaries",
            vec!["--workspace", "-e", "no-dev"],
        ),
        (
            "make release (RELEASE_PKGS)",
            [&release[..], &["-e", "no-dev"]].concat(),
        ),
        (
            "a bench (RELEASE_PKGS -p kt-bench)",
            [&with_bench[..], &["-e", "no-dev"]].concat(),
        ),
        (
            "make python (maturin: -p kt-python)",
            vec!["-p", "kt-python", "-e", "no-dev"],
        ),
        ("kt-tests alone", vec!["-p", "kt-tests"]),
    ];
    let mut broken = Vec::new();
    for (name, args) in &selections {
        for d in drift(&reference, &resolved(args)) {
            broken.push(format!("{name}: {d}"));
        }
    }
    // The benches reuse the release binaries' workspace crates as built.
    let mut bench = members(&[&with_bench[..], &["-e", "no-dev"]].concat());
    bench.retain(|name, _| !name.starts_with("kt-bench "));
    let release = members(&[&release[..], &["-e", "no-dev"]].concat());
    for (name, features) in &bench {
        if release.get(name) != Some(features) {
            broken.push(format!(
                "a bench builds workspace crate {name} with {features:?}, make release with {:?}",
                release.get(name)
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "these builds would compile a dependency again with other features; add the \
         test build's features to components/kt-workspace-hack/Cargo.toml:\n{}",
        broken.join("\n")
    );
}

#[test]
fn the_drift_check_names_a_package_resolved_with_other_features() {
    let set = |s: &str| BTreeSet::from([s.to_owned()]);
    let reference = BTreeMap::from([
        ("tokio v1.0.0".to_owned(), set("macros,rt,test-util")),
        ("serde v1.0.0".to_owned(), set("derive,std")),
    ]);
    let selection = BTreeMap::from([
        ("tokio v1.0.0".to_owned(), set("macros,rt")),
        ("serde v1.0.0".to_owned(), set("derive,std")),
        ("either v1.0.0".to_owned(), set("std")),
    ]);
    let broken = drift(&reference, &selection);
    assert_eq!(broken.len(), 2, "{broken:?}");
    assert!(
        broken[0].starts_with("either v1.0.0: [std] here"),
        "{broken:?}"
    );
    assert!(
        broken[1].starts_with("tokio v1.0.0: [macros,rt] here, [macros,rt,test-util]"),
        "{broken:?}"
    );
}
