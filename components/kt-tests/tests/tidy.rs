//! The workspace's rules as tests (rust-analyzer's "tidy" habit): what
//! ARCHITECTURE.md says about layering, `unsafe` and the wire types, checked
//! on every `make test` so a change that breaks a rule fails here with the
//! rule's reason, instead of drifting from the docs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every workspace member: its name, directory and non-dev dependencies
/// (normal and build; optional ones included: a feature may turn them on).
struct Member {
    dir: PathBuf,
    deps: BTreeSet<String>,
    dev_deps: BTreeSet<String>,
}

fn members() -> BTreeMap<String, Member> {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .current_dir(root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut members = BTreeMap::new();
    for p in meta["packages"].as_array().unwrap() {
        let (mut deps, mut dev_deps) = (BTreeSet::new(), BTreeSet::new());
        for d in p["dependencies"].as_array().unwrap() {
            let name = d["name"].as_str().unwrap().to_owned();
            if d["kind"].as_str() == Some("dev") {
                dev_deps.insert(name);
            } else {
                deps.insert(name);
            }
        }
        let manifest = PathBuf::from(p["manifest_path"].as_str().unwrap());
        members.insert(
            p["name"].as_str().unwrap().to_owned(),
            Member {
                dir: manifest.parent().unwrap().to_owned(),
                deps,
                dev_deps,
            },
        );
    }
    members
}

/// Crates that exist to test and measure the others.
const TESTBED: [&str; 3] = ["kt-tests", "kt-bench", "kt-scenario"];
const SERVERS: [&str; 3] = ["kt-metadata", "kt-store", "kt-agent"];
const HTTP: [&str; 5] = ["axum", "reqwest", "hyper", "tokio-tungstenite", "tower"];

/// Layering violations of one set of members, each with its reason.
fn layering(members: &BTreeMap<String, Member>) -> Vec<String> {
    let mut broken = Vec::new();
    let mut only = |krate: &str, allowed: &[&str], why: &str| {
        if let Some(m) = members.get(krate) {
            for d in &m.deps {
                if !allowed.contains(&d.as_str()) {
                    broken.push(format!("{krate} depends on {d}: {why}"));
                }
            }
        }
    };
    only(
        "kt-types",
        &["hex", "serde", "serde_json", "thiserror"],
        "the wire-types crate does no I/O and needs no runtime",
    );
    only(
        "kt-api",
        &[
            "kt-types",
            "bytes",
            "reqwest",
            "rustls",
            "serde",
            "serde_json",
            "thiserror",
            "tokio",
        ],
        "the HTTP client of kt's servers holds no server code (rustls: the client's CAs)",
    );
    let mut never = |krate: &str, forbidden: &[&str], why: &str| {
        if let Some(m) = members.get(krate) {
            for d in forbidden {
                if m.deps.contains(*d) {
                    broken.push(format!("{krate} depends on {d}: {why}"));
                }
            }
        }
    };
    never(
        "kt-sync",
        &HTTP,
        "the sync engine has no networking (streams in, streams out)",
    );
    never(
        "kt-tensor",
        &[&HTTP[..], &["tokio", "redb"]].concat(),
        "the transfer engine is blocking code the agent drives",
    );
    for client in [
        "kt-client",
        "kt-api",
        "kt-kube",
        "kt-service",
        "kt-sync",
        "kt-python",
        // The Dataset controller is a client of kt's servers (its tests
        // start real agents: a dev-dependency).
        "kt-dataset",
    ] {
        never(
            client,
            &[&SERVERS[..], &["redb"]].concat(),
            "a shared or client crate never depends on a server",
        );
    }
    for server in SERVERS {
        // A node-cache agent fetches datasets as a getter does (through
        // kt-client, over HTTP like any client); kt-client never links an
        // agent (the list above).
        let client = (server != "kt-agent").then_some("kt-client");
        let others: Vec<&str> = SERVERS
            .iter()
            .copied()
            .filter(|s| *s != server)
            .chain(client)
            .collect();
        never(
            server,
            &others,
            "servers talk to each other over HTTP, not by linking",
        );
    }
    for (name, m) in members {
        if TESTBED.contains(&name.as_str()) {
            continue;
        }
        for t in TESTBED {
            if m.deps.contains(t) {
                broken.push(format!(
                    "{name} depends on {t}: testbed crates are for tests and benches only"
                ));
            }
        }
    }
    // Heavy dependencies stay in the crates that need them.
    for (dep, homes) in [
        ("kube", &["kt-kube", "kt-metadata", "kt-dataset"][..]),
        // kt-scenario's bundle target reads the rendered install's pod
        // specs (the same build of it as kt-kube's: no extra compile).
        ("k8s-openapi", &["kt-kube", "kt-scenario", "kt-dataset"][..]),
        // The S3 ingest of the Dataset controller; the testbed fills its
        // buckets with the same client.
        ("object_store", &["kt-dataset", "kt-scenario"][..]),
        ("bollard", &["kt-scenario"][..]),
        ("criterion", &["kt-bench"][..]),
        ("cudarc", &["kt-tensor"][..]),
        ("redb", &["kt-metadata"][..]),
        ("pyo3", &["kt-python"][..]),
    ] {
        for (name, m) in members {
            if (m.deps.contains(dep) || m.dev_deps.contains(dep)) && !homes.contains(&name.as_str())
            {
                broken.push(format!(
                    "{name} depends on {dep}: it belongs to {} only (build size)",
                    homes.join(", ")
                ));
            }
        }
    }
    broken
}

#[test]
fn crates_depend_on_each_other_as_the_layering_says() {
    let members = members();
    assert!(members.len() >= 12, "{:?}", members.keys());
    let broken = layering(&members);
    assert!(broken.is_empty(), "layering broken:\n{}", broken.join("\n"));
}

#[test]
fn the_layering_check_catches_a_wire_type_crate_that_does_io() {
    let mut members = members();
    members
        .get_mut("kt-types")
        .unwrap()
        .deps
        .insert("reqwest".into());
    members
        .get_mut("kt-client")
        .unwrap()
        .deps
        .insert("kt-store".into());
    let broken = layering(&members);
    assert!(
        broken
            .iter()
            .any(|b| b.starts_with("kt-types depends on reqwest")),
        "{broken:?}"
    );
    assert!(
        broken
            .iter()
            .any(|b| b.starts_with("kt-client depends on kt-store")),
        "{broken:?}"
    );
}

/// Every `.rs` file under `dir`, skipping build output.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target") {
                    todo.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The code of a line: without a `//` comment (strings are rare enough in
/// the lines these checks look at).
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

#[test]
fn pure_cores_import_no_io() {
    // State machines and plans with their clock passed in: HTTP, databases,
    // files and the runtime live in the modules that wrap them.
    let cores = [
        "components/kt-metadata/src/registry.rs",
        "components/kt-metadata/src/leases.rs",
        "components/kt-metadata/src/broadcast.rs",
        "components/kt-kube/src/state.rs",
        "components/kt-sync/src/diff.rs",
        "components/kt-tensor/src/pack.rs",
        "components/kt-tensor/src/cuda/chain.rs",
        "components/kt-dataset/src/reconcile.rs",
        "components/kt-dataset/src/ingest/plan.rs",
    ];
    let extra: Vec<String> = ["components/kt-metadata/src/quorum/round.rs"]
        .into_iter()
        .filter(|p| root().join(p).exists())
        .map(str::to_owned)
        .collect();
    // Crates by name; std's I/O by path (an address type is no I/O).
    let forbidden = [
        "axum",
        "reqwest",
        "redb",
        "hyper",
        "tokio",
        "kube",
        "std::fs",
        "std::net::Tcp",
        "std::net::Udp",
    ];
    let mut broken = Vec::new();
    for rel in cores.iter().map(|s| s.to_string()).chain(extra) {
        let text = std::fs::read_to_string(root().join(&rel))
            .unwrap_or_else(|e| panic!("{rel}: {e} (a pure core moved? update this list)"));
        for (n, line) in text.lines().enumerate() {
            let c = code(line).trim();
            if !(c.starts_with("use ") || c.contains("::")) {
                continue;
            }
            for f in forbidden {
                let hit = c.split(|ch: char| !(ch.is_alphanumeric() || ch == '_' || ch == ':'));
                if hit.into_iter().any(|w| {
                    w == f
                        || w.starts_with(&format!("{f}::"))
                        || (f.contains("::") && w.starts_with(f))
                }) {
                    broken.push(format!("{rel}:{}: {f} in a pure core: {}", n + 1, c));
                }
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// Where `unsafe` may be, and why (ARCHITECTURE.md, "Unsafe"); each block
/// has a `SAFETY` note just above it.
const UNSAFE_ALLOWED: [(&str, &str); 8] = [
    ("components/kt-tensor/src/shm.rs", "mmap of shared memory"),
    (
        "components/kt-tensor/src/cuda/driver.rs",
        "the CUDA driver API",
    ),
    (
        "components/kt-tensor/src/cuda/nccl.rs",
        "NCCL through libloading",
    ),
    (
        "components/kt-scenario/src/main.rs",
        "set_var before any thread exists",
    ),
    (
        "components/kt-bench/src/metaload/joins.rs",
        "setrlimit for 10,000 connections",
    ),
    (
        "components/kt-tests/tests/fuzz.rs",
        "a counting global allocator (bounded allocation)",
    ),
    (
        "components/kt-bench/src/main.rs",
        "set_var before any thread exists",
    ),
    (
        "components/kt-tests/tests/tls.rs",
        "set_var before any thread exists",
    ),
];

#[test]
fn unsafe_lives_only_where_it_is_allowed_and_says_why() {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    assert!(
        manifest.contains("unsafe_code = \"deny\""),
        "the workspace denies unsafe_code"
    );
    let mut broken = Vec::new();
    for (name, m) in members() {
        let toml = std::fs::read_to_string(m.dir.join("Cargo.toml")).unwrap();
        if !toml.contains("[lints]\nworkspace = true") {
            broken.push(format!("{name}: no `[lints] workspace = true`"));
        }
    }
    for file in rust_files(&root().join("components")) {
        let rel = file
            .strip_prefix(root())
            .unwrap_or(&file)
            .display()
            .to_string();
        let rel = rel.trim_start_matches("./").to_owned();
        if rel.ends_with("kt-tests/tests/tidy.rs") {
            continue; // this checker names what it looks for
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in lines.iter().enumerate() {
            let c = code(line);
            let uses = c.contains("unsafe {")
                || c.contains("unsafe fn")
                || c.contains("unsafe impl")
                || c.contains("allow(unsafe_code)");
            if !uses {
                continue;
            }
            if !UNSAFE_ALLOWED.iter().any(|(f, _)| rel.ends_with(f)) {
                broken.push(format!(
                    "{rel}:{}: unsafe outside the allowed files: {}",
                    n + 1,
                    line.trim()
                ));
            } else if c.contains("unsafe {")
                && !lines[n.saturating_sub(16)..=n]
                    .iter()
                    .any(|l| l.contains("SAFETY"))
            {
                broken.push(format!(
                    "{rel}:{}: an unsafe block without a SAFETY note above it",
                    n + 1
                ));
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn every_public_item_of_the_wire_types_is_documented() {
    // The compiler checks it: a missing doc comment fails the build.
    let lib = std::fs::read_to_string(root().join("components/kt-types/src/lib.rs")).unwrap();
    assert!(
        lib.contains("#![deny(missing_docs)]"),
        "kt-types must keep #![deny(missing_docs)]"
    );
}
