//! Snapshots of what a scenario observed, asserted with insta.
//!
//! Each scenario has one YAML snapshot, `scenarios/snapshots/<name>.snap`,
//! holding the outcome of every step and what `record`/`snapshot` steps
//! captured. Values that differ from run to run (addresses, ports, times,
//! durations, temp paths, the run id, version ids) are redacted first — after
//! the timing budgets were checked on the real values.
//!
//! insta decides what happens on a mismatch from its usual environment
//! (`INSTA_UPDATE`, `CI`): locally a `.snap.new` is written for `cargo insta
//! review` (or `kt-scenario run --accept`); in CI nothing is written. The
//! assertion's panic is caught and becomes the scenario's failure, with a
//! unified diff for the report.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use insta::Snapshot;
use insta::internals::SnapshotContents;
use regex::Regex;
use serde_json::Value;

/// Rewrites run-specific values into stable placeholders.
#[derive(Debug)]
pub struct Redactor {
    literal: Vec<(String, String)>,
    patterns: Vec<(Regex, &'static str)>,
    /// Opaque ids in order of first appearance: `[id1]`, `[id2]`, ... so a
    /// snapshot still shows whether two versions are the same or differ.
    ids: std::sync::Mutex<BTreeMap<String, usize>>,
}

/// Object keys whose values are times or durations, whatever they hold.
const TIME_KEYS: &[&str] = &[
    "created_at_ms",
    "updated_at_ms",
    "expires_at_ms",
    "seconds",
    "call_seconds",
    "duration_ms",
];
/// Object keys whose values are opaque ids minted per run.
const ID_KEYS: &[&str] = &["version", "session"];
/// Beside a `version` (a key's record), an id too: the manifest's digest,
/// which depends on the generated files' modes and times. (A recorded
/// transfer's `digest`, of the data itself, stays as it is.)
const RECORD_ID_KEYS: &[&str] = &["digest"];

impl Redactor {
    /// `literals` are replaced first (longest first), e.g. the work dir → `[tmp]`.
    pub fn new(literals: Vec<(String, &'static str)>) -> Redactor {
        Redactor::with(
            literals
                .into_iter()
                .map(|(l, w)| (l, w.to_owned()))
                .collect(),
        )
    }

    /// As [`Redactor::new`], with owned replacements (a target's aliases).
    pub fn with(literals: Vec<(String, String)>) -> Redactor {
        let mut literal = literals;
        literal.retain(|(s, _)| !s.is_empty());
        literal.sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
        let re = |s: &str| Regex::new(s).unwrap_or_else(|e| unreachable!("static regex: {e}"));
        Redactor {
            literal,
            patterns: vec![
                (
                    re(r"\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}(:\d+)?\b"),
                    "[addr]",
                ),
                (re(r"\blocalhost:\d+\b"), "[addr]"),
                (re(r"/tmp/[^\s\x22']+"), "[tmp]"),
                // A duration stands alone (after a space, `(` or `=`), so
                // key and pod names such as `ckpt/30s` are left alone.
                (re(r"(^|[\s(=])\d+(\.\d+)?(ms|s)\b"), "${1}[duration]"),
            ],
            ids: std::sync::Mutex::new(BTreeMap::new()),
        }
    }

    fn id(&self, id: &str) -> String {
        let mut ids = self.ids.lock().unwrap_or_else(|e| e.into_inner());
        let next = ids.len() + 1;
        format!("[id{}]", ids.entry(id.to_owned()).or_insert(next))
    }

    pub fn string(&self, s: &str) -> String {
        let mut out = s.to_owned();
        for (lit, with) in &self.literal {
            out = out.replace(lit.as_str(), with.as_str());
        }
        for (re, with) in &self.patterns {
            out = re.replace_all(&out, *with).into_owned();
        }
        out
    }

    pub fn value(&self, v: &Value) -> Value {
        match v {
            Value::String(s) => Value::String(self.string(s)),
            Value::Array(a) => Value::Array(a.iter().map(|x| self.value(x)).collect()),
            Value::Object(o) => Value::Object(
                o.iter()
                    .map(|(k, x)| {
                        let id_key = ID_KEYS.contains(&k.as_str())
                            || (RECORD_ID_KEYS.contains(&k.as_str()) && o.contains_key("version"));
                        let red = if TIME_KEYS.contains(&k.as_str()) && !x.is_null() {
                            Value::String("[time]".into())
                        } else if let (true, Some(id)) = (id_key, x.as_str()) {
                            Value::String(self.id(id))
                        } else {
                            self.value(x)
                        };
                        (k.clone(), red)
                    })
                    .collect(),
            ),
            other => other.clone(),
        }
    }
}

/// How a run treats snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// insta's defaults (a mismatch writes `.snap.new` unless in CI).
    Auto,
    /// CI: write nothing; unreferenced snapshots fail the run.
    Check,
    /// Record: new and changed snapshots are accepted after the run.
    Accept,
}

#[derive(Debug)]
pub struct Snapshots {
    dir: PathBuf,
    mode: Mode,
    referenced: Mutex<BTreeSet<String>>,
}

/// The outcome of one snapshot assertion.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub file: PathBuf,
    pub ok: bool,
    /// A unified diff (or, for a new snapshot, its content) when not ok.
    pub diff: Option<String>,
}

/// Remembers the texts insta compared, to render our own diff for reports.
#[derive(Clone)]
struct Recording(Arc<Mutex<Option<(String, String)>>>);

fn text(c: &SnapshotContents) -> String {
    match c {
        SnapshotContents::Text(t) => t.to_string(),
        _ => "<binary>".to_owned(),
    }
}

impl insta::Comparator for Recording {
    fn matches(&self, reference: &Snapshot, test: &Snapshot) -> bool {
        let ok = insta::DefaultComparator.matches(reference, test);
        if !ok && let Ok(mut g) = self.0.lock() {
            *g = Some((text(reference.contents()), text(test.contents())));
        }
        ok
    }

    fn dyn_clone(&self) -> Box<dyn insta::Comparator> {
        Box::new(self.clone())
    }
}

/// A panic hook that keeps insta's (already printed) assertion panics quiet
/// and leaves every other panic to the default hook.
pub fn quiet_snapshot_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if !msg.starts_with("snapshot assertion for") {
            default(info);
        }
    }));
}

impl Snapshots {
    pub fn new(dir: PathBuf, mode: Mode) -> Snapshots {
        Snapshots {
            dir,
            mode,
            referenced: Mutex::new(BTreeSet::new()),
        }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn file_of(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.snap"))
    }

    /// Asserts `value` (already redacted) as the snapshot `name`.
    pub fn assert(&self, name: &str, source: &Path, description: &str, value: &Value) -> Outcome {
        self.reference(name);
        self.discard_stale(name);
        let file = self.file_of(name);
        let recording = Recording(Arc::new(Mutex::new(None)));
        let mut settings = insta::Settings::new();
        settings.set_snapshot_path(&self.dir);
        settings.set_prepend_module_to_snapshot(false);
        settings.set_omit_expression(true);
        settings.set_input_file(source);
        settings.set_description(description);
        settings.set_comparator(Box::new(recording.clone()));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            settings.bind(|| insta::assert_yaml_snapshot!(name, value));
        }));
        let compared = recording.0.lock().ok().and_then(|mut g| g.take());
        // A pass needs both: no panic, and no difference seen by the
        // comparator (INSTA_FORCE_PASS would otherwise hide one).
        if result.is_ok() && compared.is_none() {
            return Outcome {
                file,
                ok: true,
                diff: None,
            };
        }
        let diff = match compared {
            Some((old, new)) => similar::TextDiff::from_lines(&old, &new)
                .unified_diff()
                .context_radius(3)
                .header(&format!("{} (recorded)", file.display()), "this run")
                .to_string(),
            None => format!(
                "no recorded snapshot {}; run with --accept (or `cargo insta review`) to record:\n{}",
                file.display(),
                serde_yaml_ng::to_string(value).unwrap_or_default()
            ),
        };
        Outcome {
            file,
            ok: false,
            diff: Some(diff),
        }
    }

    /// With `Accept`, removes a `.snap.new` an earlier run left for `name`:
    /// this run writes the snapshot itself, and [`Snapshots::finish`] would
    /// otherwise promote the stale file over it.
    fn discard_stale(&self, name: &str) {
        if self.mode == Mode::Accept {
            let _ = std::fs::remove_file(self.dir.join(format!("{name}.snap.new")));
        }
    }

    /// Marks `name` as a snapshot some scenario owns (also when it was
    /// skipped), so it does not count as unreferenced.
    pub fn reference(&self, name: &str) {
        if let Ok(mut r) = self.referenced.lock() {
            r.insert(name.to_owned());
        }
    }

    /// `.snap` files in the directory that no scenario of this run owns.
    pub fn unreferenced(&self) -> Vec<PathBuf> {
        let referenced = self
            .referenced
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default();
        let mut out: Vec<PathBuf> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.extension().is_some_and(|e| e == "snap")
                    && p.file_stem()
                        .is_some_and(|s| !referenced.contains(s.to_string_lossy().as_ref()))
            })
            .collect();
        out.sort();
        out
    }

    /// After a run: with `Accept`, promote pending `.snap.new` files and (for a
    /// full run) delete unreferenced snapshots; with `Check`, remove any
    /// pending file this run left. Returns what it changed.
    pub fn finish(&self, full_run: bool) -> std::io::Result<Vec<String>> {
        let referenced = self
            .referenced
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default();
        let mut changed = Vec::new();
        for name in &referenced {
            let pending = self.dir.join(format!("{name}.snap.new"));
            if !pending.exists() {
                continue;
            }
            match self.mode {
                Mode::Accept => {
                    std::fs::rename(&pending, self.file_of(name))?;
                    changed.push(format!("accepted {}", self.file_of(name).display()));
                }
                Mode::Check => std::fs::remove_file(&pending)?,
                Mode::Auto => {}
            }
        }
        if self.mode == Mode::Accept && full_run {
            for f in self.unreferenced() {
                std::fs::remove_file(&f)?;
                changed.push(format!("removed unreferenced {}", f.display()));
            }
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn redaction_replaces_run_specific_values() {
        let r = Redactor::new(vec![
            ("/work/run-1".into(), "[work]"),
            ("ab12".into(), "[run]"),
        ]);
        let v = json!({
            "source": "http://127.0.0.3:40123",
            "key": "rt-ab12/tree",
            "path": "/work/run-1/pods/a/out",
            "created_at_ms": 1700000000000u64,
            "expires_at_ms": null,
            "version": "v-8f3a",
            "digest": "c0ffee",
            "files": 12,
            "msg": "timed out after 10s at 10.1.2.3",
            "recorded": { "digest": "d47a", "bytes": 4 },
        });
        let out = r.value(&v);
        assert_eq!(
            out,
            json!({
                "source": "http://[addr]",
                "key": "rt-[run]/tree",
                "path": "[work]/pods/a/out",
                "created_at_ms": "[time]",
                "expires_at_ms": null,
                "version": "[id2]",
                "digest": "[id1]",
                "files": 12,
                "msg": "timed out after [duration] at [addr]",
                // A transfer's digest of its data is no record's: kept.
                "recorded": { "digest": "d47a", "bytes": 4 },
            })
        );
    }

    #[test]
    fn matching_mismatching_and_unreferenced_snapshots() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("s.yaml");
        std::fs::write(dir.path().join("alpha.snap"), "---\nsource: x\n---\na: 1\n").unwrap();
        std::fs::write(dir.path().join("stale.snap"), "---\n---\nx\n").unwrap();
        let snaps = Snapshots::new(dir.path().to_owned(), Mode::Check);
        assert!(snaps.assert("alpha", &src, "d", &json!({"a": 1})).ok);
        let o = snaps.assert("alpha", &src, "d", &json!({"a": 2}));
        assert!(!o.ok);
        let diff = o.diff.unwrap();
        assert!(diff.contains("-a: 1") && diff.contains("+a: 2"), "{diff}");
        // A snapshot nobody recorded yet fails and shows what it would hold.
        let o = snaps.assert("beta", &src, "d", &json!({"b": true}));
        assert!(!o.ok && o.diff.unwrap().contains("b: true"));
        snaps.finish(true).unwrap();
        assert!(!dir.path().join("alpha.snap.new").exists());
        assert!(!dir.path().join("beta.snap.new").exists());
        assert_eq!(snaps.unreferenced(), vec![dir.path().join("stale.snap")]);
    }

    #[test]
    fn accepting_discards_what_an_earlier_run_left_pending() {
        let dir = tempfile::tempdir().unwrap();
        let pending = dir.path().join("gamma.snap.new");
        std::fs::write(
            &pending,
            "---
---
old: run
",
        )
        .unwrap();
        Snapshots::new(dir.path().to_owned(), Mode::Check).discard_stale("gamma");
        assert!(pending.exists(), "only an accepting run discards it");
        Snapshots::new(dir.path().to_owned(), Mode::Accept).discard_stale("gamma");
        assert!(!pending.exists());
    }
}
