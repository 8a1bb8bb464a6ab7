//! ARCHITECTURE.md's "the one X" and "only" rules that a reading of the
//! source can check: each a [`OneWay`] (the lines that do X, the files
//! allowed to), with a test over the workspace and one over a planted
//! line. Rules about what the code does at run time are tests of their
//! own (the closing note of issue #36 lists them).

use super::{OneWay, root, rust_files};

/// Whether `c` builds a [`kt_types::KeyError`] (a pattern such as
/// `KeyError::BadChar { .. }` or a match arm only reads one).
fn builds_key_error(c: &str) -> bool {
    c.match_indices("KeyError::").any(|(i, m)| {
        let rest = &c[i + m.len()..];
        rest.starts_with(|ch: char| ch.is_ascii_uppercase())
            && !rest.contains("{ ..")
            && !rest.contains("=>")
    })
}

/// Keys have one grammar, `kt_types::key` (`Key::parse`,
/// `KeyPrefix::parse`): no other code says why a string is not a key or
/// how long one may be.
pub(super) const KEY_GRAMMAR: OneWay = OneWay {
    why: "a key grammar outside kt_types::key (parse with Key::parse or KeyPrefix::parse, \
          the one key grammar, instead of checking segments or lengths)",
    hit: |c| builds_key_error(c) || c.contains("MAX_KEY_LEN"),
    allowed: |rel| rel == "components/kt-types/src/key.rs",
    tests: true,
};

/// The binary units a byte count is shown in.
const BINARY_UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];

/// Whether `c` formats bytes for people: a table of unit prefixes (two or
/// more quoted on one line), or a format placeholder followed by a binary
/// unit (`{:.1} KiB`, `{} MiB`), a rate (`MiB/s`) aside.
fn formats_bytes(c: &str) -> bool {
    let prefixes = ["\"Ki", "\"Mi", "\"Gi", "\"Ti"]
        .iter()
        .filter(|p| c.contains(**p))
        .count();
    let placeholder = c.match_indices('}').any(|(i, _)| {
        let rest = c[i + 1..].trim_start_matches(' ');
        BINARY_UNITS.iter().any(|u| {
            rest.strip_prefix(u)
                .is_some_and(|after| !after.starts_with('/'))
        })
    });
    prefixes >= 2 || placeholder
}

/// Byte counts are shown by `kt_types::size::human`, the one byte
/// formatter (CLI summaries, `kt status`, scenario steps, bench tables).
pub(super) const BYTE_FORMATTER: OneWay = OneWay {
    why: "bytes formatted for people outside kt_types::size (call kt_types::size::human, \
          the one byte formatter)",
    hit: formats_bytes,
    allowed: |rel| rel == "components/kt-types/src/size.rs",
    tests: true,
};

/// Whether `c` computes a rank from a share of a sample's length
/// (`v[(v.len() as f64 * 0.95) as usize]`, `(p / 100.0) * v.len() ...`).
fn ranks_a_sample(c: &str) -> bool {
    c.contains("len()")
        && (c.contains("/ 100") || c.contains("* 0."))
        && ["as usize", "ceil()", "floor()", "round()"]
            .iter()
            .any(|r| c.contains(r))
}

/// Percentiles of a sample are `kt_types::stats::percentile`'s, the one
/// percentile (nearest rank, `None` on an empty sample); wrappers that
/// call it are fine.
pub(super) const PERCENTILE: OneWay = OneWay {
    why: "a percentile computed outside kt_types::stats (call kt_types::stats::percentile, \
          the one percentile: nearest rank, None on an empty sample)",
    hit: ranks_a_sample,
    allowed: |rel| rel == "components/kt-types/src/stats.rs",
    tests: true,
};

/// Whether `c` decodes an error answer: an `ErrorBody` read from JSON, or
/// an HTTP status mapped to an `ErrorCode`.
fn decodes_an_answer(c: &str) -> bool {
    let reads_body = c.contains("ErrorBody")
        && [
            "from_str",
            "from_slice",
            "from_value",
            "from_reader",
            ".json",
            ": ErrorBody",
        ]
        .iter()
        .any(|d| c.contains(d));
    reads_body || c.contains("ErrorCode::from_status")
}

/// An answer of a kt server becomes a `CallError` in one place,
/// `kt_api::check` (the one answer decoder); tests read error bodies to
/// assert them.
pub(super) const ANSWER_DECODER: OneWay = OneWay {
    why: "an error answer decoded outside kt_api::check (call kt_api::check, the one answer \
          decoder, and match on its CallError)",
    hit: decodes_an_answer,
    allowed: |rel| rel == "components/kt-api/src/lib.rs",
    tests: false,
};

/// "Bytes of a directory on disk" is `kt_sync::du::disk_bytes`: the sign
/// of another is a file's size read from its metadata with a 0 for what
/// cannot be read, the idiom of a walk that sums them.
pub(super) const DISK_BYTES: OneWay = OneWay {
    why: "a directory's bytes summed outside kt_sync::du (call kt_sync::du::disk_bytes, the \
          one \"bytes of a directory on disk\")",
    hit: |c| {
        c.contains("metadata")
            && c.contains("len()")
            && (c.contains("unwrap_or(0)") || c.contains("map_or(0"))
    },
    allowed: |rel| rel == "components/kt-sync/src/du.rs",
    tests: true,
};

/// Whether `c` takes a group step's children out of its action
/// (`Action::Parallel(c)`, `Action::Sequence(steps)`: a binding, not `_`),
/// or iterates `children()` (a walk of its own).
fn walks_steps(c: &str) -> bool {
    let binds = ["Action::Parallel(", "Action::Sequence("].iter().any(|g| {
        c.match_indices(g)
            .any(|(i, m)| !c[i + m.len()..].starts_with('_'))
    });
    binds || c.contains(".children().iter()")
}

/// `Step::walk` (and `Step::any` over it) is the one walk over nested
/// steps; the runner alone takes a group's children, to run them in
/// parallel or in order, which no visitor can.
pub(super) const STEP_WALK: OneWay = OneWay {
    why: "nested steps walked outside Step::walk (call Step::walk or Step::any, the one walk \
          over nested steps)",
    hit: walks_steps,
    allowed: |rel| {
        [
            "components/kt-scenario/src/format/step.rs",
            "components/kt-scenario/src/runner/mod.rs",
        ]
        .contains(&rel)
    },
    tests: true,
};

/// Whether `c` declares an enum of faults (`enum Fault`, `enum ChaosFault`).
fn declares_a_fault_enum(c: &str) -> bool {
    c.split("enum ").skip(1).any(|rest| {
        rest.split(|ch: char| !(ch.is_alphanumeric() || ch == '_'))
            .next()
            .is_some_and(|name| name.contains("Fault"))
    })
}

/// The runner's steps and the chaos soak build one `Fault` enum
/// (`kt_scenario::fault`), injected by `Fault::inject`.
pub(super) const FAULT_ENUM: OneWay = OneWay {
    why: "a fault enum outside kt_scenario::fault (add a variant to Fault, the one fault \
          enum, and its arm to Fault::inject)",
    hit: declares_a_fault_enum,
    allowed: |rel| rel == "components/kt-scenario/src/fault.rs",
    tests: true,
};

/// The files of the runner and the chaos soak, which see pods only
/// through the `Target` trait.
fn runner_file(rel: &str) -> bool {
    rel.starts_with("components/kt-scenario/src/runner/")
        || rel == "components/kt-scenario/src/chaos.rs"
        || rel.starts_with("components/kt-scenario/src/chaos/")
}

/// The concrete targets' modules and types.
const TARGETS: [&str; 8] = [
    "docker", "netns", "bundle", "cluster", "kind", "k3d", "local", "host",
];
const TARGET_TYPES: [&str; 5] = ["Docker::", "Netns::", "Bundle::", "Local::", "Cluster::"];

/// Whether `c` reaches a concrete target: its module (a message constant,
/// `SCREAMING_CASE`, aside: words, not a way to a pod) or its type.
fn names_a_target(c: &str) -> bool {
    let module = TARGETS.iter().any(|t| {
        let path = format!("target::{t}::");
        c.match_indices(&path).any(|(i, m)| {
            let item: String = c[i + m.len()..]
                .chars()
                .take_while(|ch| ch.is_alphanumeric() || *ch == '_')
                .collect();
            item.is_empty() || item.chars().any(|ch| ch.is_ascii_lowercase())
        })
    });
    module
        || TARGET_TYPES.iter().any(|t| {
            c.match_indices(t).any(|(i, _)| {
                !c[..i].ends_with(|ch: char| ch.is_alphanumeric() || ch == '_' || ch == ':')
            })
        })
}

/// The runner and the soak see pods only through the `Target` trait:
/// what a target cannot do is its `TargetError`, never a branch here.
pub(super) const TARGET_TRAIT: OneWay = OneWay {
    why: "the runner names a concrete target (it sees pods only through the Target trait: \
          add a trait method, each target's answer, a skip where one cannot)",
    hit: names_a_target,
    allowed: |rel| !runner_file(rel),
    tests: false,
};

/// The front ends: the `kt` binary's command-line modules and the Python
/// package's Rust half.
fn front_end(rel: &str) -> bool {
    [
        "components/kt-client/src/main.rs",
        "components/kt-client/src/cli.rs",
        "components/kt-client/src/tensor_cli.rs",
        "components/kt-client/src/dataset_cli.rs",
    ]
    .contains(&rel)
        || rel.starts_with("components/kt-python/src/")
}

/// kt-client is the one engine behind the CLI, the Rust API and Python:
/// the front ends call `Client` and speak no protocol of their own (no
/// endpoint path, no HTTP call).
pub(super) const ONE_ENGINE: OneWay = OneWay {
    why: "protocol code in a front end (the CLI and Python call kt_client::Client, the one \
          engine; endpoints and HTTP calls live in kt-client and kt-api)",
    hit: |c| {
        c.contains("paths::")
            || c.contains("reqwest")
            || c.contains("kt_api::Api")
            || c.contains("Api::new")
            || c.contains("kt_api::check")
    },
    allowed: |rel| !front_end(rel),
    tests: false,
};

#[test]
fn the_one_key_grammar_is_kt_types_key() {
    let broken = KEY_GRAMMAR.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_one_byte_formatter_is_kt_types_size() {
    let broken = BYTE_FORMATTER.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_one_percentile_is_kt_types_stats() {
    let broken = PERCENTILE.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_one_answer_decoder_is_kt_api_check() {
    let broken = ANSWER_DECODER.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_one_bytes_of_a_directory_is_kt_sync_du() {
    let broken = DISK_BYTES.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_one_walk_over_nested_steps_is_step_walk() {
    let broken = STEP_WALK.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_one_fault_enum_is_kt_scenario_fault() {
    let broken = FAULT_ENUM.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_runner_sees_pods_only_through_the_target_trait() {
    let broken = TARGET_TRAIT.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_cli_and_python_run_on_the_one_engine() {
    let broken = ONE_ENGINE.check();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_one_rules_read_files_that_exist() {
    // A rule whose allowed file moved would allow nothing and pass.
    for f in [
        "components/kt-types/src/key.rs",
        "components/kt-types/src/size.rs",
        "components/kt-types/src/stats.rs",
        "components/kt-api/src/lib.rs",
        "components/kt-sync/src/du.rs",
        "components/kt-scenario/src/format/step.rs",
        "components/kt-scenario/src/runner/mod.rs",
        "components/kt-scenario/src/fault.rs",
        "components/kt-scenario/src/chaos.rs",
        "components/kt-client/src/cli.rs",
        "components/kt-python/src/lib.rs",
    ] {
        assert!(
            root().join(f).is_file(),
            "{f} moved: update tidy/the_one.rs"
        );
    }
    assert!(
        rust_files(&root().join("components/kt-scenario/src/runner")).len() > 3,
        "the runner's files moved: update tidy/the_one.rs"
    );
}

#[test]
fn the_one_rules_catch_a_planted_line_and_skip_comments() {
    // (rule, a file it holds, a violation)
    let plants: [(&OneWay, &str, &str); 13] = [
        (
            &KEY_GRAMMAR,
            "components/kt-store/src/put.rs",
            "return Err(KeyError::Empty);",
        ),
        (
            &KEY_GRAMMAR,
            "components/kt-client/src/lib.rs",
            "if k.len() > kt_types::key::MAX_KEY_LEN {",
        ),
        (
            &BYTE_FORMATTER,
            "components/kt-bench/src/compare.rs",
            "format!(\"{:.1} MiB\", b as f64 / 1048576.0)",
        ),
        (
            &BYTE_FORMATTER,
            "components/kt-scenario/src/report.rs",
            "const UNITS: [&str; 3] = [\"KiB\", \"MiB\", \"GiB\"];",
        ),
        (
            &PERCENTILE,
            "components/kt-bench/src/report.rs",
            "let p95 = v[(v.len() as f64 * 0.95) as usize];",
        ),
        (
            &ANSWER_DECODER,
            "components/kt-client/src/transfer.rs",
            "let body: ErrorBody = serde_json::from_str(&text)?;",
        ),
        (
            &ANSWER_DECODER,
            "components/kt-agent/src/metadata.rs",
            "let code = ErrorCode::from_status(resp.status().as_u16());",
        ),
        (
            &DISK_BYTES,
            "components/kt-store/src/metrics.rs",
            "_ => e.metadata().map_or(0, |m| m.len()),",
        ),
        (
            &STEP_WALK,
            "components/kt-scenario/src/validate.rs",
            "Action::Parallel(steps) | Action::Sequence(steps) => {",
        ),
        (
            &FAULT_ENUM,
            "components/kt-scenario/src/chaos.rs",
            "pub enum ChaosFault {",
        ),
        (
            &TARGET_TRAIT,
            "components/kt-scenario/src/runner/fault.rs",
            "if let Some(d) = crate::target::docker::Docker::of(target) {",
        ),
        (
            &ONE_ENGINE,
            "components/kt-client/src/cli.rs",
            "let url = kt_types::paths::keys(&key);",
        ),
        (
            &ONE_ENGINE,
            "components/kt-python/src/lib.rs",
            "let resp = reqwest::get(url).await?;",
        ),
    ];
    for (rule, file, bad) in plants {
        let text = format!("//! doc\n// {bad}\n{bad}\n");
        let broken = rule.broken([(file, text.as_str())]);
        assert_eq!(
            broken,
            [format!("{file}:3: {}: {bad}", rule.why)],
            "a violation on line 3 only (line 2 is a comment)"
        );
    }
}

#[test]
fn the_one_rules_allow_the_one_place_and_what_is_not_the_thing() {
    for (rule, file, fine) in [
        // The grammar itself, and a test matching a variant.
        (
            &KEY_GRAMMAR,
            "components/kt-types/src/key.rs",
            "return Err(KeyError::Empty);",
        ),
        (
            &KEY_GRAMMAR,
            "components/kt-types/src/shard.rs",
            "TicketError::Prefix(crate::KeyError::DotSegment { .. })",
        ),
        (
            &KEY_GRAMMAR,
            "components/kt-service/src/error.rs",
            "KeyError::Empty => ErrorCode::InvalidKey,",
        ),
        // A rate is not a byte count; parsing is not formatting.
        (
            &BYTE_FORMATTER,
            "components/kt-bench/src/compare.rs",
            "\" (kt {:.0} MiB/s {:.2} cpu-s/GiB)\",",
        ),
        (
            &BYTE_FORMATTER,
            "components/kt-scenario/src/target/bundle/kubelet.rs",
            "\"Mi\" => 1024.0 * 1024.0,",
        ),
        (
            &BYTE_FORMATTER,
            "components/kt-types/src/size.rs",
            "const PREFIXES: [&str; 6] = [\"Ki\", \"Mi\", \"Gi\", \"Ti\", \"Pi\", \"Ei\"];",
        ),
        (
            &PERCENTILE,
            "components/kt-bench/src/compare.rs",
            "let count = (tree.len() / 100).max(1);",
        ),
        (
            &PERCENTILE,
            "components/kt-scenario/src/runner/budget.rs",
            "kt_types::stats::percentile(sorted, p).unwrap_or(0.0)",
        ),
        // Answers are made by servers and read by tests.
        (
            &ANSWER_DECODER,
            "components/kt-service/src/error.rs",
            "let body = ErrorBody::new(self.code, self.message);",
        ),
        (
            &ANSWER_DECODER,
            "components/kt-tests/tests/roles.rs",
            "let body: kt_types::ErrorBody = resp.json().await.unwrap();",
        ),
        // One file's size is not a directory's.
        (
            &DISK_BYTES,
            "components/kt-agent/src/flight.rs",
            "let size = f.metadata()?.len();",
        ),
        (
            &STEP_WALK,
            "components/kt-scenario/src/validate.rs",
            "if matches!(step.action, Action::Parallel(_) | Action::Sequence(_))",
        ),
        (
            &STEP_WALK,
            "components/kt-scenario/src/runner/mod.rs",
            "Action::Parallel(children) => {",
        ),
        (
            &FAULT_ENUM,
            "components/kt-scenario/src/runner/fault.rs",
            "async fn inject(&self, faults: Vec<Fault>) -> Result<(), StepError> {",
        ),
        (
            &TARGET_TRAIT,
            "components/kt-scenario/src/runner/mod.rs",
            "use crate::target::local::NO_PYTHON;",
        ),
        (
            &TARGET_TRAIT,
            "components/kt-scenario/src/runner/mod.rs",
            "key.locale == Locale::Local",
        ),
        (
            &TARGET_TRAIT,
            "components/kt-scenario/src/target/docker.rs",
            "let d = Docker::new(plan);",
        ),
        (
            &ONE_ENGINE,
            "components/kt-client/src/transfer.rs",
            "let url = kt_types::paths::keys(&key);",
        ),
    ] {
        let broken = rule.broken([(file, fine)]);
        assert!(broken.is_empty(), "{file}: {fine}: {broken:?}");
    }
    // A rule that leaves tests out skips a `#[cfg(test)]` module, and
    // nothing after it.
    let text = "fn f() {}\n#[cfg(test)]\nmod tests {\n    fn t() {\n        \
                let b: ErrorBody = serde_json::from_str(s).unwrap();\n    }\n}\n\
                fn g() { let b: ErrorBody = serde_json::from_str(s)?; }\n";
    let broken = ANSWER_DECODER.broken([("components/kt-client/src/lib.rs", text)]);
    assert_eq!(broken.len(), 1, "{broken:?}");
    assert!(
        broken[0].starts_with("components/kt-client/src/lib.rs:8:"),
        "{broken:?}"
    );
}
