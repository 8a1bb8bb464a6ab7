//! The live view: on a terminal, a spinner per running step (with a pods
//! counter for steps that run in many pods) above the lines of finished
//! steps; elsewhere (CI logs), one plain line per finished step.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::report::{ScenarioReport, Status, StepReport};

#[derive(Debug)]
pub struct Live {
    multi: Option<MultiProgress>,
    color: bool,
    bars: Mutex<HashMap<String, ProgressBar>>,
}

impl Default for Live {
    fn default() -> Self {
        let mut live = Live::new(std::io::stderr().is_terminal());
        live.color = kt_service::telemetry::stderr_color();
        live
    }
}

fn secs(ms: f64) -> String {
    if ms < 1000.0 {
        format!("{ms:.0}ms")
    } else {
        format!("{:.2}s", ms / 1000.0)
    }
}

impl Live {
    /// `interactive`: draw spinners (a terminal); otherwise plain lines.
    pub fn new(interactive: bool) -> Live {
        Live {
            multi: interactive
                .then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr())),
            color: interactive,
            bars: Mutex::new(HashMap::new()),
        }
    }

    /// A line above the spinners (or on stderr).
    pub fn line(&self, msg: &str) {
        match &self.multi {
            Some(m) => {
                let _ = m.println(msg);
            }
            None => eprintln!("{msg}"),
        }
    }

    fn paint(&self, code: &str, s: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_owned()
        }
    }

    pub fn scenario_start(&self, name: &str, i: usize, n: usize) {
        self.line(&self.paint("1", &format!("▶ [{i}/{n}] {name}")));
    }

    pub fn scenario_end(&self, r: &ScenarioReport) {
        let (mark, code) = match r.status {
            Status::Passed => ("PASS", "32"),
            Status::Failed => ("FAIL", "31"),
            Status::Skipped => ("SKIP", "33"),
        };
        let mut line = format!(
            "{} {} (testbed up in {}, total {})",
            self.paint(code, mark),
            r.name,
            secs(r.setup_ms),
            secs(r.duration_ms)
        );
        if let Some(m) = &r.message {
            line.push_str(&format!(": {m}"));
        }
        self.line(&line);
        if let Some(d) = &r.snapshot_diff {
            self.line(d);
        }
    }

    pub fn skipped(&self, name: &str, why: &str) {
        self.line(&format!("{} {name}: {why}", self.paint("33", "SKIP")));
    }

    pub fn step_start(&self, index: &str, label: &str) {
        let Some(m) = &self.multi else { return };
        let bar = m.add(ProgressBar::new_spinner());
        bar.set_style(
            ProgressStyle::with_template("  {spinner} {prefix} {msg} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_prefix(index.to_owned());
        bar.set_message(label.to_owned());
        bar.enable_steady_tick(Duration::from_millis(100));
        if let Ok(mut b) = self.bars.lock() {
            b.insert(index.to_owned(), bar);
        }
    }

    /// `done` of `total` pods have finished the step `index`.
    pub fn pods_done(&self, index: &str, done: usize, total: usize) {
        if let Some(bar) = self.bars.lock().ok().and_then(|b| b.get(index).cloned()) {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_style(
                ProgressStyle::with_template(
                    "  {spinner} {prefix} {msg} [{bar:20}] {pos}/{len} pods {elapsed}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
        }
    }

    pub fn step_end(&self, r: &StepReport) {
        if let Some(bar) = self.bars.lock().ok().and_then(|mut b| b.remove(&r.index)) {
            bar.finish_and_clear();
            if let Some(m) = &self.multi {
                m.remove(&bar);
            }
        }
        let mark = match r.status {
            Status::Passed => self.paint("32", "✓"),
            Status::Failed => self.paint("31", "✗"),
            Status::Skipped => self.paint("33", "-"),
        };
        let pods = if r.pods.len() > 1 {
            format!(" ({} pods)", r.pods.len())
        } else {
            String::new()
        };
        let mut line = format!(
            "  {mark} {} {}{pods} {}",
            r.index,
            r.name,
            secs(r.duration_ms)
        );
        // Worth a word only where it may explain the time.
        if let Some(busy) = r.cpu_busy.filter(|_| r.duration_ms >= 1000.0) {
            line.push_str(&format!(" (cpu {:.0}%)", busy * 100.0));
        }
        if let Some(e) = &r.error {
            line.push_str(&format!(": {e}"));
        }
        self.line(&line);
    }
}
