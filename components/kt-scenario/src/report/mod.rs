//! What a run produced, and its renderings: the terminal summary table,
//! `report.json` (this model, serialized), JUnit XML for CI and a
//! self-contained HTML page with plots.

use std::path::Path;

use serde::{Deserialize, Serialize};

pub mod html;
pub mod junit;
pub mod terminal;

/// A whole `kt-scenario run`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunReport {
    pub run_id: String,
    pub target: String,
    /// RFC 3339, UTC.
    pub started_at: String,
    pub duration_ms: f64,
    pub scenarios: Vec<ScenarioReport>,
    /// Unreferenced snapshot files found after a full run (a failure with
    /// `--check`).
    #[serde(default)]
    pub unreferenced_snapshots: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Passed,
    Failed,
    Skipped,
}

/// One scenario file's run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScenarioReport {
    pub name: String,
    /// The scenario file, as given on the command line.
    pub file: String,
    pub tags: Vec<String>,
    pub status: Status,
    /// Why it was skipped, or the first failure, in one line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Testbed bring-up time (metadata, store and pods ready).
    pub setup_ms: f64,
    pub pods: usize,
    pub duration_ms: f64,
    /// Steps in the order they ended: the children of a `parallel` or
    /// `sequence` (dotted index, `3.1`) come before the group itself.
    pub steps: Vec<StepReport>,
    /// The snapshot file this scenario asserted on, relative to the repo.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// A readable diff when the snapshot did not match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_diff: Option<String>,
    /// Where the failure dump (logs, metadata state, step context) is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dump_dir: Option<String>,
}

/// One step's run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepReport {
    /// `3`, or `3.1` for the first child of step 3 (1-based).
    pub index: String,
    pub name: String,
    /// The action (`put`, `get`, ...).
    pub kind: String,
    pub status: Status,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Wall time of the step as the runner saw it.
    pub duration_ms: f64,
    /// Time spent in the operations themselves: from the first pod command's
    /// start to the last one's exit.
    pub op_ms: f64,
    /// `duration_ms - op_ms` for steps that run commands: the runner's cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overhead_ms: Option<f64>,
    /// Budget checks made on this step (all of them, passed or not).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<BudgetCheck>,
    /// Per-pod results of steps that run in pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<PodResult>,
    /// How busy the host's cores were during the step (0 to 1, all cores
    /// together, from `/proc/stat`): near 1, the step's time is these
    /// cores' limit, not the links' or the design's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_busy: Option<f64>,
}

/// One limit of a timing budget, checked on real durations (before any
/// redaction).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BudgetCheck {
    /// `max`, `min`, `p50` or `p95`.
    pub kind: String,
    pub limit_ms: f64,
    pub actual_ms: f64,
    pub ok: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PodResult {
    pub pod: String,
    pub ok: bool,
    pub duration_ms: f64,
    /// Milliseconds from the step's start to this pod's completion.
    pub finished_at_ms: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The start of what the pod's command printed (exec steps print
    /// figures worth keeping, like an agent's peak memory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
}

impl RunReport {
    pub fn failed(&self) -> usize {
        self.scenarios
            .iter()
            .filter(|s| s.status == Status::Failed)
            .count()
    }

    pub fn passed(&self) -> usize {
        self.scenarios
            .iter()
            .filter(|s| s.status == Status::Passed)
            .count()
    }

    /// True when the run must exit non-zero.
    pub fn is_failure(&self, check_unreferenced: bool) -> bool {
        self.failed() > 0 || (check_unreferenced && !self.unreferenced_snapshots.is_empty())
    }

    /// The largest runner overhead of any command step (ms).
    pub fn max_overhead_ms(&self) -> Option<f64> {
        self.scenarios
            .iter()
            .flat_map(|s| s.steps.iter())
            .filter_map(|s| s.overhead_ms)
            .reduce(f64::max)
    }

    /// Writes `report.json`, `junit.xml` and `report.html` into `dir`.
    pub fn write_all(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(dir.join("report.json"), json)?;
        std::fs::write(dir.join("junit.xml"), junit::render(self))?;
        std::fs::write(dir.join("report.html"), html::render(self))?;
        Ok(())
    }
}
