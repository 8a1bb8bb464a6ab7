//! The performance regression gate (`make bench-gate`): the rsync
//! comparison ([`crate::compare`]) run a few times, the median kt/rsync ratio
//! of each case held against a committed baseline
//! (`testbed/bench/baseline.json`).
//!
//! Ratios, not times: kt and rsync run side by side in each run, so a busy or
//! slow machine slows both alike and the ratio stays. A case fails when its
//! median ratio over the invocations is above `baseline × (1 + margin)`.
//! The baseline keeps one set of ratios per profile (`quick`: a smaller tree
//! and file, for CI's time budget; `full`: the issue's sizes), each with the
//! command that recorded it; `--accept` rewrites a profile's ratios from a
//! run, which is how a change that moves a figure updates the baseline.
//! Each case is held twice: its time ratio (`small_cold`) and its CPU ratio
//! (`small_cold.cpu`, kt's CPU seconds over rsync's), which a busy machine
//! hardly moves.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::compare::Options;
use crate::report::{CaseResult, median};

/// The committed baseline, relative to the repository root.
pub const BASELINE: &str = "testbed/bench/baseline.json";

/// The baseline file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    /// For people: what the file is and how to update it.
    #[serde(default)]
    pub about: String,
    pub profiles: BTreeMap<String, ProfileBaseline>,
}

/// The ratios of one profile.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfileBaseline {
    /// The command that measured these ratios.
    pub command: String,
    /// When and how busy the machine was (free text).
    #[serde(default)]
    pub measured: String,
    /// Relative slack: a case fails above `ratio × (1 + margin)`.
    pub margin: f64,
    pub cases: BTreeMap<String, CaseBaseline>,
}

/// One case's baseline ratio (kt time / rsync time).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CaseBaseline {
    pub ratio: f64,
    /// This case's own margin, where its timing is noisier than the rest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub margin: Option<f64>,
}

impl Baseline {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let b: Baseline = serde_json::from_str(&text)
            .with_context(|| format!("parsing {} as a baseline", path.display()))?;
        for (name, p) in &b.profiles {
            anyhow::ensure!(
                p.margin.is_finite() && p.margin >= 0.0,
                "{}: profile {name}: margin must be a number ≥ 0",
                path.display()
            );
            for (case, c) in &p.cases {
                anyhow::ensure!(
                    c.ratio.is_finite() && c.ratio > 0.0,
                    "{}: profile {name}, case {case}: ratio must be a number > 0",
                    path.display()
                );
                anyhow::ensure!(
                    c.margin.is_none_or(|m| m.is_finite() && m >= 0.0),
                    "{}: profile {name}, case {case}: margin must be a number ≥ 0",
                    path.display()
                );
            }
        }
        Ok(b)
    }

    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        let mut text = serde_json::to_string_pretty(self)?;
        text.push('\n');
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    }
}

/// What the gate measures: a size of data and a number of runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Profile {
    /// 2,000 small files and a 128 MiB file, 3 runs per case: about a
    /// minute on a 2-core machine, for CI.
    Quick,
    /// The issue's sizes: 10,000 small files and a 1 GiB file, 5 runs.
    Full,
}

impl Profile {
    pub fn name(self) -> &'static str {
        match self {
            Profile::Quick => "quick",
            Profile::Full => "full",
        }
    }

    /// The comparison's options for this profile, working under `dir`.
    pub fn options(self, dir: PathBuf) -> Options {
        let (files, large_size, runs) = match self {
            Profile::Quick => (2_000, 128 << 20, 3),
            Profile::Full => (10_000, 1 << 30, 5),
        };
        Options {
            dir,
            files,
            large_size,
            runs,
            warmup: 1,
            skip_large: false,
            tls: None,
            cases: Vec::new(),
        }
    }
}

/// The ratio of each case in each invocation, in the order measured.
pub type Measured = BTreeMap<String, Vec<f64>>;

/// The suffix of a case's CPU figure in [`Measured`] and the baseline:
/// `small_cold.cpu` is kt's CPU seconds over rsync's in `small_cold`.
pub const CPU_SUFFIX: &str = ".cpu";

/// Adds one invocation's results to `m`: each case's time ratio under its
/// name and its CPU ratio under `NAME.cpu`. CPU time hardly moves when
/// other work shares the machine, where wall time does (kt's threads wait
/// for cores that rsync's single process needs fewer of): a regression
/// that costs work shows in the CPU ratio even on a busy machine.
pub fn add_invocation(m: &mut Measured, results: &[CaseResult]) {
    for r in results {
        m.entry(r.name.to_owned()).or_default().push(r.ratio());
        m.entry(format!("{}{CPU_SUFFIX}", r.name))
            .or_default()
            .push(median(&r.kt_cpu) / median(&r.rsync_cpu));
    }
}

/// How one case fared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Pass,
    /// Its median ratio is above the limit.
    Fail,
    /// Measured, but the baseline has no ratio for it (reported, not failed).
    New,
    /// In the baseline, but not measured: a failure (a case went missing).
    Missing,
    /// An invocation's ratio is not a finite number (it measured nothing,
    /// or rsync's CPU was 0): a failure, whatever the median says — the
    /// median of three would hide one broken invocation.
    Invalid,
}

/// One line of the gate's table.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub case: String,
    pub ratios: Vec<f64>,
    pub median: f64,
    pub baseline: Option<f64>,
    pub limit: Option<f64>,
    pub outcome: Outcome,
}

/// Holds each measured case's median ratio against `base`.
pub fn judge(base: &ProfileBaseline, measured: &Measured) -> Vec<Verdict> {
    let mut names: Vec<&String> = measured.keys().collect();
    names.extend(base.cases.keys().filter(|k| !measured.contains_key(*k)));
    names
        .into_iter()
        .map(|case| {
            let ratios = measured.get(case).cloned().unwrap_or_default();
            let med = median(&ratios);
            let b = base.cases.get(case);
            let limit = b.map(|b| b.ratio * (1.0 + b.margin.unwrap_or(base.margin)));
            let outcome = match (limit, ratios.is_empty()) {
                _ if ratios.iter().any(|r| !r.is_finite()) => Outcome::Invalid,
                (None, _) => Outcome::New,
                (Some(_), true) => Outcome::Missing,
                (Some(l), false) if med <= l => Outcome::Pass,
                (Some(_), false) => Outcome::Fail,
            };
            Verdict {
                case: case.clone(),
                ratios,
                median: med,
                baseline: b.map(|b| b.ratio),
                limit,
                outcome,
            }
        })
        .collect()
}

/// Whether every case passed (new cases do not fail the gate).
pub fn passed(verdicts: &[Verdict]) -> bool {
    verdicts
        .iter()
        .all(|v| matches!(v.outcome, Outcome::Pass | Outcome::New))
}

fn opt(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_owned(), |x| format!("{x:.3}"))
}

/// The gate's table: each case's ratios, median, baseline, limit, verdict.
pub fn table(verdicts: &[Verdict]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<14} {:>8} {:>8} {:>8}  {:<8} ratios (kt/rsync) per invocation",
        "case", "median", "baseline", "limit", "verdict"
    );
    for v in verdicts {
        let verdict = match v.outcome {
            Outcome::Pass => "ok",
            Outcome::Fail => "SLOWER",
            Outcome::New => "new",
            Outcome::Missing => "MISSING",
            Outcome::Invalid => "INVALID",
        };
        let ratios: Vec<String> = v.ratios.iter().map(|r| format!("{r:.3}")).collect();
        let _ = writeln!(
            out,
            "{:<14} {:>8.3} {:>8} {:>8}  {:<8} {}",
            v.case,
            v.median,
            opt(v.baseline),
            opt(v.limit),
            verdict,
            ratios.join(" ")
        );
    }
    out
}

/// Replaces `profile`'s ratios in `b` with the medians of `measured`,
/// keeping per-case margins of cases still measured; a profile new to the
/// file gets `margin`.
pub fn accept(
    b: &mut Baseline,
    profile: Profile,
    measured: &Measured,
    command: &str,
    when: &str,
    margin: Option<f64>,
) {
    let p = b.profiles.entry(profile.name().to_owned()).or_default();
    if let Some(m) = margin {
        p.margin = m;
    } else if p.cases.is_empty() && p.margin == 0.0 {
        p.margin = DEFAULT_MARGIN;
    }
    p.command = command.to_owned();
    p.measured = when.to_owned();
    let old = std::mem::take(&mut p.cases);
    for (case, ratios) in measured {
        p.cases.insert(
            case.clone(),
            CaseBaseline {
                ratio: round3(median(ratios)),
                margin: old.get(case).and_then(|c| c.margin),
            },
        );
    }
}

/// The margin a profile recorded for the first time gets.
pub const DEFAULT_MARGIN: f64 = 0.3;

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> ProfileBaseline {
        ProfileBaseline {
            command: "c".into(),
            measured: String::new(),
            margin: 0.25,
            cases: [
                (
                    "small_cold".to_owned(),
                    CaseBaseline {
                        ratio: 0.4,
                        margin: None,
                    },
                ),
                (
                    "small_noop".to_owned(),
                    CaseBaseline {
                        ratio: 0.2,
                        margin: Some(1.0),
                    },
                ),
            ]
            .into(),
        }
    }

    fn measured(pairs: &[(&str, &[f64])]) -> Measured {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
            .collect()
    }

    #[test]
    fn a_median_above_the_margin_fails_and_one_within_passes() {
        // small_cold: limit 0.4 × 1.25 = 0.5; the median 0.49 passes even
        // though one invocation was slower.
        let v = judge(
            &base(),
            &measured(&[("small_cold", &[0.45, 0.7, 0.49]), ("small_noop", &[0.39])]),
        );
        assert_eq!(v[0].outcome, Outcome::Pass, "{v:?}");
        assert!((v[0].limit.unwrap() - 0.5).abs() < 1e-9);
        // small_noop has its own margin: limit 0.4.
        assert_eq!(v[1].outcome, Outcome::Pass);
        assert!(passed(&v));

        let v = judge(
            &base(),
            &measured(&[("small_cold", &[0.51, 0.52, 0.45]), ("small_noop", &[0.41])]),
        );
        assert_eq!(v[0].outcome, Outcome::Fail);
        assert_eq!(v[1].outcome, Outcome::Fail);
        assert!(!passed(&v));
        let t = table(&v);
        assert!(t.contains("SLOWER"), "{t}");
    }

    #[test]
    fn an_invocation_adds_time_and_cpu_ratios() {
        let r = CaseResult {
            name: "small_cold",
            kt: vec![1.0, 2.0, 3.0],
            rsync: vec![4.0],
            kt_cpu: vec![0.5],
            rsync_cpu: vec![2.0, 2.0],
            ..CaseResult::default()
        };
        let mut m = Measured::new();
        add_invocation(&mut m, std::slice::from_ref(&r));
        add_invocation(&mut m, &[r]);
        assert_eq!(m["small_cold"], [0.5, 0.5]);
        assert_eq!(m["small_cold.cpu"], [0.25, 0.25]);
    }

    #[test]
    fn new_cases_are_reported_and_missing_ones_fail() {
        let v = judge(
            &base(),
            &measured(&[("small_cold", &[0.3]), ("large_get", &[0.9])]),
        );
        let by: BTreeMap<&str, Outcome> = v.iter().map(|v| (v.case.as_str(), v.outcome)).collect();
        assert_eq!(by["large_get"], Outcome::New);
        assert_eq!(by["small_noop"], Outcome::Missing);
        assert!(!passed(&v));
    }

    #[test]
    fn one_invocation_that_measured_nothing_fails_whatever_the_median() {
        // The median of [0.40, 0.45, NaN] is 0.45 (NaN sorts last): the
        // broken invocation must not be outvoted by the two good ones.
        for bad in [f64::NAN, f64::INFINITY, -f64::NAN] {
            let v = judge(
                &base(),
                &measured(&[("small_cold", &[0.40, 0.45, bad]), ("small_noop", &[0.1])]),
            );
            assert_eq!(v[0].outcome, Outcome::Invalid, "{bad}: {v:?}");
            assert_eq!(v[1].outcome, Outcome::Pass);
            assert!(!passed(&v));
            assert!(table(&v).contains("INVALID"));
        }
        // A case new to the baseline is judged the same way.
        let v = judge(&base(), &measured(&[("large_get", &[f64::NAN])]));
        assert_eq!(v[0].outcome, Outcome::Invalid);
    }

    #[test]
    fn accept_records_medians_and_keeps_case_margins() {
        let mut b = Baseline::default();
        b.profiles.insert("quick".into(), base());
        accept(
            &mut b,
            Profile::Quick,
            &measured(&[("small_noop", &[0.3, 0.1, 0.2]), ("large_cold", &[0.61234])]),
            "make bench-gate",
            "today",
            None,
        );
        let p = &b.profiles["quick"];
        assert_eq!(p.margin, 0.25);
        assert_eq!(
            p.cases["small_noop"],
            CaseBaseline {
                ratio: 0.2,
                margin: Some(1.0)
            }
        );
        assert_eq!(p.cases["large_cold"].ratio, 0.612);
        assert!(!p.cases.contains_key("small_cold"));
        accept(
            &mut b,
            Profile::Full,
            &measured(&[("x", &[1.0])]),
            "c",
            "t",
            None,
        );
        assert_eq!(b.profiles["full"].margin, DEFAULT_MARGIN);

        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("baseline.json");
        b.save(&path).unwrap();
        assert_eq!(Baseline::load(&path).unwrap(), b);
        std::fs::write(
            &path,
            r#"{"profiles":{"quick":{"command":"","margin":-1,"cases":{}}}}"#,
        )
        .unwrap();
        assert!(Baseline::load(&path).is_err());
    }

    #[test]
    fn the_committed_baseline_parses_and_covers_every_case() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(BASELINE);
        let b = Baseline::load(&path).unwrap();
        for profile in [Profile::Quick, Profile::Full] {
            let p = &b.profiles[profile.name()];
            for case in [
                "small_cold",
                "small_noop",
                "small_changed",
                "large_cold",
                "large_get",
            ] {
                assert!(p.cases.contains_key(case), "{}: {case}", profile.name());
                let cpu = format!("{case}{CPU_SUFFIX}");
                assert!(p.cases.contains_key(&cpu), "{}: {cpu}", profile.name());
            }
        }
    }
}
