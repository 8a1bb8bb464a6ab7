//! The runner on itself: real `kt-scenario` runs of small scenarios against
//! the local target (the kt binaries must be built beside it: `make test`
//! builds them first).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin_dir() -> PathBuf {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_kt-scenario"));
    let dir = exe.parent().expect("binary dir").to_owned();
    for b in ["kt", "kt-metadata", "kt-store"] {
        assert!(
            dir.join(b).is_file(),
            "{} is missing: build the workspace binaries first (cargo build --workspace --bins)",
            dir.join(b).display()
        );
    }
    dir
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Copies the self-test scenario `name` (and its snapshot) into a temp dir
/// and runs it there, so nothing is written into the repository.
fn run(name: &str, extra: &[&str]) -> (tempfile::TempDir, Output) {
    run_from(&bin_dir(), name, extra)
}

/// [`run`] with the kt binaries of `bins`.
fn run_from(bins: &Path, name: &str, extra: &[&str]) -> (tempfile::TempDir, Output) {
    let tmp = tempfile::tempdir().unwrap();
    let src = repo().join("testbed/selftest");
    std::fs::create_dir_all(tmp.path().join("s/snapshots")).unwrap();
    std::fs::copy(
        src.join(format!("{name}.yaml")),
        tmp.path().join(format!("s/{name}.yaml")),
    )
    .unwrap();
    let snap = src.join(format!("snapshots/{name}.snap"));
    if snap.exists() {
        std::fs::copy(&snap, tmp.path().join(format!("s/snapshots/{name}.snap"))).unwrap();
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kt-scenario"))
        .arg("run")
        .arg(tmp.path().join(format!("s/{name}.yaml")))
        .arg("--report")
        .arg(tmp.path().join("report"))
        .arg("--work-dir")
        .arg(tmp.path().join("work"))
        .arg("--bin-dir")
        .arg(bins)
        .args(extra)
        .env("INSTA_WORKSPACE_ROOT", tmp.path())
        .env_remove(kt_types::env::SCENARIO_TAGS)
        .output()
        .unwrap();
    (tmp, out)
}

/// Runs the whole copied directory again in `--check` mode (a full run).
fn check_again(tmp: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kt-scenario"))
        .args(["run", "--check", "--bin-dir"])
        .arg(bin_dir())
        .arg("--report")
        .arg(tmp.join("report2"))
        .arg("--work-dir")
        .arg(tmp.join("work"))
        .arg(tmp.join("s"))
        .env("INSTA_WORKSPACE_ROOT", tmp)
        .output()
        .unwrap()
}

fn report(tmp: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(tmp.join("report/report.json")).unwrap()).unwrap()
}

#[test]
fn a_snapshot_mismatch_fails_with_a_diff_and_a_dump() {
    let (tmp, out) = run("broken-snapshot", &["--check"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let r = report(tmp.path());
    let s = &r["scenarios"][0];
    assert_eq!(s["status"], "failed");
    let diff = s["snapshot_diff"].as_str().unwrap();
    assert!(
        diff.contains("-    files: 3") && diff.contains("+    files: 4"),
        "{diff}"
    );
    assert!(
        stderr.contains("+    files: 4"),
        "the diff is shown: {stderr}"
    );
    let dump = PathBuf::from(s["dump_dir"].as_str().unwrap());
    for f in [
        "logs/metadata.log",
        "logs/store.log",
        "metadata.json",
        "failure.txt",
        "snapshot.diff",
    ] {
        assert!(dump.join(f).is_file(), "{f} missing in the dump");
    }
    let state = std::fs::read_to_string(dump.join("metadata.json")).unwrap();
    assert!(state.contains("broken-snapshot/tree"), "{state}");
    let junit = std::fs::read_to_string(tmp.path().join("report/junit.xml")).unwrap();
    assert!(junit.contains("<failure"), "{junit}");
    // --check writes no pending snapshot and leaves the recorded one alone.
    assert!(
        !tmp.path()
            .join("s/snapshots/broken-snapshot.snap.new")
            .exists()
    );
    // The testbed is gone: no work dir left behind.
    assert_eq!(
        std::fs::read_dir(tmp.path().join("work")).unwrap().count(),
        0
    );
}

#[test]
fn a_failing_step_dumps_its_context_and_still_runs_finally() {
    let (tmp, out) = run("broken-step", &["--check"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = report(tmp.path());
    let s = &r["scenarios"][0];
    let steps = s["steps"].as_array().unwrap();
    assert_eq!(steps[0]["status"], "failed");
    assert!(
        steps[0]["error"].as_str().unwrap().contains("not_found")
            || steps[0]["error"].as_str().unwrap().contains("not-found")
    );
    assert_eq!(steps[1]["index"], "finally.1", "finally ran");
    let failure =
        std::fs::read_to_string(PathBuf::from(s["dump_dir"].as_str().unwrap()).join("failure.txt"))
            .unwrap();
    assert!(
        failure.contains("get broken-step/nothing") && failure.contains("stderr:"),
        "{failure}"
    );
}

#[test]
fn accepting_records_a_snapshot_that_then_passes_in_check_mode() {
    let (tmp, out) = run("broken-snapshot", &["--accept"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let snap =
        std::fs::read_to_string(tmp.path().join("s/snapshots/broken-snapshot.snap")).unwrap();
    assert!(snap.contains("files: 4"), "{snap}");
    // Run again from the same directory, in check mode.
    let out = check_again(tmp.path());
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let html = std::fs::read_to_string(tmp.path().join("report2/report.html")).unwrap();
    assert!(html.contains("<svg"), "the HTML report has plots");
}

#[test]
fn unreferenced_snapshots_fail_a_full_check_run() {
    let (tmp, _) = run("broken-snapshot", &["--accept"]);
    std::fs::write(tmp.path().join("s/snapshots/orphan.snap"), "---\n---\nx\n").unwrap();
    let out = check_again(tmp.path());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("orphan.snap"), "{stderr}");
}

/// `python3` on PATH: `make test` needs it anyway (the Python package).
fn python3() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("python3"))
        .find(|p| p.is_file())
        .expect("python3 on PATH")
}

#[test]
fn a_python_step_runs_its_script_in_every_pod_and_a_failing_one_fails() {
    let python = python3();
    let (tmp, out) = run(
        "python-step",
        &["--check", "--python", python.to_str().unwrap()],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let r = report(tmp.path());
    let steps = r["scenarios"][0]["steps"].as_array().unwrap().clone();
    assert_eq!(steps[0]["status"], "passed", "{steps:#?}");
    assert_eq!(steps[1]["status"], "passed", "{steps:#?}");
}

#[test]
fn python_scenarios_are_skipped_with_the_fix_when_there_is_no_interpreter() {
    // kt's binaries, with no `../python` venv beside them.
    let bins = tempfile::tempdir().unwrap();
    let dir = bins.path().join("debug");
    std::fs::create_dir(&dir).unwrap();
    for b in ["kt", "kt-metadata", "kt-store", "kt-agent"] {
        std::os::unix::fs::symlink(bin_dir().join(b), dir.join(b)).unwrap();
    }
    let (tmp, out) = run_from(&dir, "python-step", &["--check"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "a skip is no failure: {stderr}");
    let s = &report(tmp.path())["scenarios"][0];
    assert_eq!(s["status"], "skipped", "{s:#?}");
    assert!(
        s["message"].as_str().unwrap_or("").contains("make python"),
        "{s:#?}"
    );
}

#[test]
fn validate_reports_file_line_and_column() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("bad.yaml");
    std::fs::write(
        &f,
        "topology:\n  pods:\n    - name: app\nsteps:\n  - put: { pod: app, key: k, data: nope }\n  - get: { pod: nobody, key: k }\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kt-scenario"))
        .arg("validate")
        .arg(&f)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let shown = f.display().to_string();
    assert!(
        stderr.contains(&format!("{shown}:5:36: no data set named `nope`")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("{shown}:6:17: no pod named `nobody`")),
        "{stderr}"
    );
}

#[test]
fn the_repository_scenarios_are_valid() {
    let out = Command::new(env!("CARGO_BIN_EXE_kt-scenario"))
        .arg("validate")
        .arg(repo().join("scenarios"))
        .arg(repo().join("testbed/selftest"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `s3_put` against moto's server (topology `s3`): the recorded syncs (30
/// files in; 2 changed + 1 added put and 1 deleted; nothing the second time)
/// match the snapshot. Without moto the scenario is skipped, saying how to
/// install it; under CI=true that fails (the S3 tests' rule).
#[test]
fn s3_put_syncs_a_prefix_with_a_data_set() {
    let (tmp, out) = run("s3-sync", &["--check"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let r = report(tmp.path());
    let s = &r["scenarios"][0];
    if s["status"] == "skipped" && !matches!(std::env::var("CI").as_deref(), Ok("true" | "1")) {
        let why = s["message"].as_str().unwrap_or_default();
        assert!(why.contains("moto"), "{why}");
        eprintln!("skipped: {why}");
        return;
    }
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(s["status"], "passed", "{s}");
}

/// A `promql` step out of its bounds fails the scenario, and the dump's
/// failure.txt holds the PromQL it ran and Prometheus's answer. Without
/// Prometheus the scenario is skipped, saying how to install it; under
/// CI=true that fails.
#[test]
fn a_promql_step_out_of_bounds_dumps_its_query() {
    let (tmp, out) = run("promql-out-of-bounds", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let r = report(tmp.path());
    let s = &r["scenarios"][0];
    if s["status"] == "skipped" && !matches!(std::env::var("CI").as_deref(), Ok("true" | "1")) {
        let why = s["message"].as_str().unwrap_or_default();
        assert!(why.contains("apt-get install prometheus"), "{why}");
        eprintln!("skipped: {why}");
        return;
    }
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(s["status"], "failed", "{s}");
    let dump = PathBuf::from(s["dump_dir"].as_str().unwrap());
    let failure = std::fs::read_to_string(dump.join("failure.txt")).unwrap();
    assert!(failure.contains("PromQL: count(up == 1)"), "{failure}");
    assert!(failure.contains("3 is above at_most 2"), "{failure}");
}
