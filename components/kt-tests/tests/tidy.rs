//! The workspace's rules as tests (rust-analyzer's "tidy" habit): what
//! ARCHITECTURE.md says about layering, `unsafe`, pure cores and the wire
//! types, and the map's own shape (short, code map first, docs/ linked), checked
//! on every `make test` so a change that breaks a rule fails here with the
//! rule's reason, instead of drifting from the docs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The roles table against the routers.
#[path = "tidy/roles_table.rs"]
mod roles_table;

/// ARCHITECTURE.md's "the one X" rules (key grammar, byte formatter,
/// percentile, answer decoder, ...).
#[path = "tidy/the_one.rs"]
mod the_one;

/// One feature set per dependency across the Makefile's builds.
#[path = "tidy/one_build.rs"]
mod one_build;

/// Every workspace member: its name, directory and non-dev dependencies
/// (normal and build; optional ones included: a feature may turn them on).
struct Member {
    dir: PathBuf,
    deps: BTreeSet<String>,
    dev_deps: BTreeSet<String>,
    /// The features each non-dev dependency turns on.
    dep_features: BTreeMap<String, BTreeSet<String>>,
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
        let mut dep_features = BTreeMap::<String, BTreeSet<String>>::new();
        for d in p["dependencies"].as_array().unwrap() {
            let name = d["name"].as_str().unwrap().to_owned();
            if d["kind"].as_str() == Some("dev") {
                dev_deps.insert(name);
            } else {
                let features = d["features"].as_array().into_iter().flatten();
                dep_features
                    .entry(name.clone())
                    .or_default()
                    .extend(features.filter_map(|f| f.as_str()).map(str::to_owned));
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
                dep_features,
            },
        );
    }
    members
}

/// Holds no code: its dependencies pin features (tidy/one_build.rs).
const HACK: &str = "kt-workspace-hack";

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
    never(
        "kt-python",
        &[&HTTP[..], &["kt-api"]].concat(),
        "the Python package wraps kt-client, the one engine: no protocol code of its own",
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
        // Arrow Flight on agents (the `flight` feature) and its test.
        ("arrow-flight", &["kt-agent", "kt-tests"][..]),
        ("parquet", &["kt-agent", "kt-tests"][..]),
        ("tonic", &["kt-agent", "kt-tests"][..]),
    ] {
        for (name, m) in members {
            // The feature-unifying crate names tonic (and others) only to
            // pin their features; it has no code and links none of them.
            if name == HACK {
                continue;
            }
            if (m.deps.contains(dep) || m.dev_deps.contains(dep)) && !homes.contains(&name.as_str())
            {
                broken.push(format!(
                    "{name} depends on {dep}: it belongs to {} only (build size)",
                    homes.join(", ")
                ));
            }
        }
    }
    // Test doubles are for tests: a dev-dependency feature only.
    for (name, m) in members {
        for (dep, features) in &m.dep_features {
            for f in TEST_ONLY_FEATURES {
                if features.contains(f) {
                    broken.push(format!(
                        "{name} turns on {dep}'s feature `{f}` outside [dev-dependencies]: \
                         test doubles are a dev-dependency feature only"
                    ));
                }
            }
        }
    }
    broken
}

/// Features that hold test doubles (`kt_tensor::testing`): turned on by
/// dev-dependencies only, so no release binary links a fake.
const TEST_ONLY_FEATURES: [&str; 1] = ["testing"];

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
    members
        .get_mut("kt-python")
        .unwrap()
        .deps
        .insert("kt-api".into());
    members
        .get_mut("kt-agent")
        .unwrap()
        .dep_features
        .entry("kt-tensor".into())
        .or_default()
        .insert("testing".into());
    let broken = layering(&members);
    assert!(
        broken
            .iter()
            .any(|b| b.starts_with("kt-python depends on kt-api")),
        "{broken:?}"
    );
    assert!(
        broken
            .iter()
            .any(|b| b.starts_with("kt-agent turns on kt-tensor's feature `testing`")),
        "{broken:?}"
    );
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

/// Every `.rs` file under `dir`, skipping build output (a `target` beside
/// a `Cargo.toml`, or any directory cargo tagged; not a module named
/// `target`, such as kt-scenario's).
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let build_output = |p: &Path| {
        p.join("CACHEDIR.TAG").is_file()
            || (p.file_name().is_some_and(|n| n == "target")
                && p.parent().is_some_and(|d| d.join("Cargo.toml").is_file()))
    };
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                if !build_output(&p) {
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

/// State machines and plans with their clock passed in: HTTP, databases,
/// files and the runtime live in the modules that wrap them. ARCHITECTURE.md
/// names each under its crate ("Pure:").
const PURE_CORES: [&str; 10] = [
    "components/kt-metadata/src/registry.rs",
    "components/kt-metadata/src/leases.rs",
    "components/kt-metadata/src/broadcast.rs",
    "components/kt-metadata/src/quorum/round.rs",
    "components/kt-kube/src/state.rs",
    "components/kt-sync/src/diff.rs",
    "components/kt-tensor/src/pack.rs",
    "components/kt-tensor/src/cuda/chain.rs",
    "components/kt-dataset/src/reconcile.rs",
    "components/kt-dataset/src/ingest/plan.rs",
];

#[test]
fn pure_cores_import_no_io() {
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
    for rel in PURE_CORES {
        let text = std::fs::read_to_string(root().join(rel))
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
const UNSAFE_ALLOWED: &[(&str, &str)] = &[
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
    (
        "components/kt-bench/src/cpu.rs",
        "getrusage and sysconf for CPU time",
    ),
    (
        "components/kt-tensor/src/cuda/netenv.rs",
        "getifaddrs, and NCCL's environment set before any thread exists",
    ),
    (
        "components/kt-agent/src/main.rs",
        "NCCL's environment set before the runtime starts",
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

/// ARCHITECTURE.md is a map, not a manual: short, its code map near the top,
/// and every page of `docs/` reachable from it (the specs live there).
const MAP_MAX_LINES: usize = 400;
/// The heading of the code map, and the line it must start by.
const MAP_CODE_MAP: &str = "## Code map";
const MAP_CODE_MAP_BY: usize = 100;
/// The heading of the list of files that may use `unsafe`.
const MAP_UNSAFE: &str = "## Unsafe";

fn architecture_md() -> String {
    std::fs::read_to_string(root().join("ARCHITECTURE.md")).expect("ARCHITECTURE.md")
}

/// The file names of `docs/*.md`.
fn doc_pages() -> Vec<String> {
    let mut pages: Vec<String> = std::fs::read_dir(root().join("docs"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".md"))
                .collect()
        })
        .unwrap_or_default();
    pages.sort();
    pages
}

/// What is wrong with `map` as the workspace's map, given the pages of
/// `docs/`: too long, a code map that starts too late (or not at all), a
/// page no link reaches, a link to a page that does not exist.
fn map_problems(map: &str, pages: &[String]) -> Vec<String> {
    let mut broken = Vec::new();
    let lines = map.lines().count();
    if lines > MAP_MAX_LINES {
        broken.push(format!(
            "ARCHITECTURE.md has {lines} lines, more than {MAP_MAX_LINES}: move specs, \
             measurements and long explanations into docs/ and link them"
        ));
    }
    match map.lines().position(|l| l.trim_end() == MAP_CODE_MAP) {
        Some(n) if n < MAP_CODE_MAP_BY => {} // n counts from 0
        Some(n) => broken.push(format!(
            "ARCHITECTURE.md's \"{MAP_CODE_MAP}\" starts at line {}, after line {MAP_CODE_MAP_BY}: \
             the map comes first",
            n + 1
        )),
        None => broken.push(format!("ARCHITECTURE.md has no \"{MAP_CODE_MAP}\" heading")),
    }
    for page in pages {
        if !map.contains(&format!("(docs/{page})")) && !map.contains(&format!("(docs/{page}#")) {
            broken.push(format!(
                "docs/{page} is linked from nowhere in ARCHITECTURE.md: link it where its topic is"
            ));
        }
    }
    for (n, line) in map.lines().enumerate() {
        for link in line.split("](docs/").skip(1) {
            let target = link.split([')', '#']).next().unwrap_or("");
            if !target.is_empty() && !pages.iter().any(|p| p == target) {
                broken.push(format!(
                    "ARCHITECTURE.md:{}: a link to docs/{target}, which does not exist",
                    n + 1
                ));
            }
        }
    }
    broken
}

#[test]
fn architecture_md_is_a_short_map_that_links_every_doc() {
    let broken = map_problems(&architecture_md(), &doc_pages());
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_map_check_catches_a_long_map_a_late_code_map_and_an_unlinked_doc() {
    let pages = vec!["a.md".to_owned(), "b.md".to_owned()];
    let good = format!("# A\n{MAP_CODE_MAP}\n[a](docs/a.md) [b](docs/b.md#x)\n");
    assert!(map_problems(&good, &pages).is_empty(), "{good}");
    let long = format!("{good}{}", "line\n".repeat(MAP_MAX_LINES));
    let late = format!(
        "# A\n{}{MAP_CODE_MAP}\n[a](docs/a.md) [b](docs/b.md)\n",
        "\n".repeat(MAP_CODE_MAP_BY)
    );
    let unlinked = format!("# A\n{MAP_CODE_MAP}\n[a](docs/a.md) [c](docs/c.md)\n");
    for (map, expect) in [
        (long, "more than"),
        (late, "after line"),
        (unlinked.clone(), "docs/b.md is linked from nowhere"),
        (unlinked, "docs/c.md, which does not exist"),
    ] {
        let broken = map_problems(&map, &pages);
        assert!(
            broken.iter().any(|b| b.contains(expect)),
            "{expect}: {broken:?}"
        );
    }
}

/// The files ARCHITECTURE.md's "Unsafe" section lists (its bullets' first
/// code span).
fn unsafe_files_in_map(map: &str) -> BTreeSet<String> {
    map.lines()
        .skip_while(|l| l.trim_end() != MAP_UNSAFE)
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .filter_map(|l| l.strip_prefix("- `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn architecture_md_lists_exactly_the_files_that_may_use_unsafe() {
    let listed = unsafe_files_in_map(&architecture_md());
    let allowed: BTreeSet<String> = UNSAFE_ALLOWED.iter().map(|(f, _)| f.to_string()).collect();
    let missing: Vec<_> = allowed.difference(&listed).collect();
    let extra: Vec<_> = listed.difference(&allowed).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "ARCHITECTURE.md's \"{MAP_UNSAFE}\" and tidy's UNSAFE_ALLOWED disagree: \
         not in the map {missing:?}, not allowed by tidy {extra:?}"
    );
}

#[test]
fn architecture_md_names_every_pure_core_under_its_crate() {
    let map = architecture_md();
    let mut broken = Vec::new();
    for core in PURE_CORES {
        let rest = core.strip_prefix("components/").unwrap();
        let (krate, file) = rest.split_once("/src/").unwrap();
        let bullet: String = map
            .lines()
            .skip_while(|l| !l.starts_with(&format!("- **{krate}**")))
            .take_while({
                let mut first = true;
                move |l| std::mem::take(&mut first) || l.starts_with("  ")
            })
            .collect::<Vec<_>>()
            .join("\n");
        if !bullet.contains(&format!("`{file}`")) {
            broken.push(format!(
                "{core} is a pure core (tidy checks it) but ARCHITECTURE.md's code map does \
                 not name `{file}` under {krate}"
            ));
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// A "the one X" rule: the lines of `components/` whose code (comments
/// stripped) `hit` matches, outside the files `allowed` accepts, each as
/// `file:line: why: the line`.
struct OneWay {
    why: &'static str,
    hit: fn(&str) -> bool,
    allowed: fn(&str) -> bool,
    /// Whether test code (files under `tests/`, `tests.rs` modules, and
    /// the item after a `#[cfg(test)]`) is held to the rule too.
    tests: bool,
}

/// Whether `rel` is a file of test code as a whole: an integration test,
/// or a `tests.rs` module (declared under `#[cfg(test)]`).
fn test_file(rel: &str) -> bool {
    rel.contains("/tests/") || rel.ends_with("/tests.rs")
}

/// The 0-based numbers of the lines of `text` inside a `#[cfg(test)]`
/// item: the attribute's line to the item's `;`, or to its closing brace
/// (the first line at the attribute's indentation that starts with `}`,
/// as rustfmt writes it).
fn cfg_test_lines(text: &str) -> BTreeSet<usize> {
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut inside = BTreeSet::new();
    // Some(indentation): within a cfg(test) item; `braced`: past its `{`.
    let mut item: Option<usize> = None;
    let mut braced = false;
    for (n, line) in text.lines().enumerate() {
        let c = code(line);
        if item.is_none() && c.trim() == "#[cfg(test)]" {
            item = Some(indent(line));
            braced = false;
            inside.insert(n);
            continue;
        }
        let Some(at) = item else { continue };
        inside.insert(n);
        if !braced && c.trim_start().starts_with("#[") {
            continue; // another attribute of the item
        }
        let closes = braced && indent(line) == at && c.trim_start().starts_with('}');
        if closes || (!braced && c.trim_end().ends_with(';')) {
            item = None;
        } else if c.trim_end().ends_with('{') {
            braced = true;
        }
    }
    inside
}

impl OneWay {
    /// The violations among `files` (path relative to the root, text).
    fn broken<'a>(&self, files: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<String> {
        let mut broken = Vec::new();
        for (rel, text) in files {
            if rel.ends_with("kt-tests/tests/tidy.rs")
                || rel.contains("kt-tests/tests/tidy/")
                || (self.allowed)(rel)
                || (!self.tests && test_file(rel))
            {
                continue; // this checker names what it looks for
            }
            let skip = if self.tests {
                BTreeSet::new()
            } else {
                cfg_test_lines(text)
            };
            for (n, line) in text.lines().enumerate() {
                if !skip.contains(&n) && (self.hit)(code(line)) {
                    broken.push(format!("{rel}:{}: {}: {}", n + 1, self.why, line.trim()));
                }
            }
        }
        broken
    }

    /// The violations in the workspace's sources.
    fn check(&self) -> Vec<String> {
        let files: Vec<(String, String)> = rust_files(&root().join("components"))
            .into_iter()
            .map(|f| {
                let rel = f.strip_prefix(root()).unwrap_or(&f).display().to_string();
                let text = std::fs::read_to_string(&f).unwrap();
                (rel.trim_start_matches("./").to_owned(), text)
            })
            .collect();
        self.broken(files.iter().map(|(r, t)| (r.as_str(), t.as_str())))
    }
}

/// `anyhow` at the edges only: binaries (`src/main.rs`, `src/bin/`), the
/// `kt` binary's command-line modules, and the benchmark crate (a testbed
/// of binaries). Libraries say what failed with `thiserror` types.
const ANYHOW_ONLY: OneWay = OneWay {
    why: "anyhow outside a binary (libraries return thiserror types; ARCHITECTURE.md, \
          \"Errors\")",
    hit: |c| c.contains("anyhow"),
    allowed: |rel| {
        rel.ends_with("/src/main.rs")
            || rel.contains("/src/bin/")
            || rel.starts_with("components/kt-bench/")
            || [
                "components/kt-client/src/cli.rs",
                "components/kt-client/src/tensor_cli.rs",
                "components/kt-client/src/dataset_cli.rs",
            ]
            .contains(&rel)
    },
    tests: true,
};

/// Blocking work goes through `kt_sync::task` (`blocking`, `spawn`): a lost
/// worker becomes the caller's error in one place.
const SPAWN_BLOCKING_ONLY: OneWay = OneWay {
    why: "spawn_blocking outside kt_sync::task (use kt_sync::task::blocking or spawn)",
    hit: |c| c.contains("spawn_blocking"),
    allowed: |rel| rel == "components/kt-sync/src/task.rs",
    tests: true,
};

/// Every `reqwest` client starts from `kt_api::client_builder` (no proxy, a
/// connect timeout) or `kt_api::tls::http_builder`.
const REQWEST_BUILDERS_ONLY: OneWay = OneWay {
    why: "a reqwest client built outside kt-api (start from kt_api::client_builder())",
    hit: |c| {
        c.contains("Client::builder()")
            || c.contains("ClientBuilder::new()")
            || c.contains("reqwest::Client::new()")
    },
    allowed: |rel| rel.starts_with("components/kt-api/src/"),
    tests: true,
};

/// Environment variable names live in `kt_types::env`, each documented once
/// there (what it means, who reads it, its default); code names them by
/// those constants (clap: `env = kt_types::env::NAME`).
const ENV_NAMES_ONLY_IN_KT_TYPES: OneWay = OneWay {
    why: "a \"KT_ string literal outside kt_types::env (env var names live in kt_types::env \
          so each is documented once: add or use a constant there)",
    hit: |c| c.contains("\"KT_"),
    allowed: |rel| rel == "components/kt-types/src/env.rs",
    tests: true,
};

#[test]
fn anyhow_is_used_only_at_the_binaries_edges() {
    let broken = ANYHOW_ONLY.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn spawn_blocking_is_called_only_in_kt_sync_task() {
    let broken = SPAWN_BLOCKING_ONLY.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn reqwest_clients_are_built_only_in_kt_api() {
    let broken = REQWEST_BUILDERS_ONLY.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn env_var_names_are_written_only_in_kt_types_env() {
    let broken = ENV_NAMES_ONLY_IN_KT_TYPES.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_one_way_rules_catch_a_planted_violation_and_skip_comments() {
    let lib = "components/kt-store/src/put.rs";
    for (rule, bad) in [
        (&ANYHOW_ONLY, "fn f() -> anyhow::Result<()> {"),
        (&SPAWN_BLOCKING_ONLY, "tokio::task::spawn_blocking(f);"),
        (
            &REQWEST_BUILDERS_ONLY,
            "let c = reqwest::Client::builder();",
        ),
        (&REQWEST_BUILDERS_ONLY, "let c = reqwest::Client::new();"),
        (
            &ENV_NAMES_ONLY_IN_KT_TYPES,
            "let t = std::env::var(\"KT_TOKEN\");",
        ),
    ] {
        let text = format!("//! doc\n// {bad}\n{bad}\n");
        let broken = rule.broken([(lib, text.as_str())]);
        assert_eq!(
            broken,
            [format!("{lib}:3: {}: {bad}", rule.why)],
            "a violation on line 3 only (line 2 is a comment)"
        );
    }
    // Where each rule allows it.
    let text = "anyhow::bail!(); spawn_blocking; reqwest::Client::new()";
    assert!(
        ANYHOW_ONLY
            .broken([("components/kt-agent/src/main.rs", text)])
            .is_empty()
    );
    assert!(
        ANYHOW_ONLY
            .broken([("components/kt-client/src/cli.rs", text)])
            .is_empty()
    );
    assert!(
        SPAWN_BLOCKING_ONLY
            .broken([("components/kt-sync/src/task.rs", text)])
            .is_empty()
    );
    assert!(
        REQWEST_BUILDERS_ONLY
            .broken([("components/kt-api/src/lib.rs", text)])
            .is_empty()
    );
    assert!(
        ENV_NAMES_ONLY_IN_KT_TYPES
            .broken([(
                "components/kt-types/src/env.rs",
                "pub const TOKEN: &str = \"KT_TOKEN\";"
            )])
            .is_empty()
    );
}
