//! The terminal summary: one row per scenario, the failures in detail, then
//! the totals. Also the small text helpers the other renderings share
//! (durations, status words, one-line messages, aligned columns).

use std::fmt::{self, Write as _};

use super::{BudgetCheck, RunReport, ScenarioReport, Status};

/// How much of a failure or skip message the table shows.
const MESSAGE_WIDTH: usize = 80;

pub fn render(r: &RunReport, color: bool) -> String {
    let mut out = String::new();
    write_report(&mut out, r, Paint(color)).expect("writing to a String cannot fail");
    out
}

fn write_report(out: &mut String, r: &RunReport, paint: Paint) -> fmt::Result {
    if r.scenarios.is_empty() {
        writeln!(out, "no scenarios ran")?;
    } else {
        let mut rows = vec![
            [
                "STATUS", "SCENARIO", "STEPS", "SETUP", "DURATION", "MESSAGE",
            ]
            .map(String::from)
            .to_vec(),
        ];
        rows.extend(r.scenarios.iter().map(|s| {
            let message = match (s.status, &s.message) {
                (Status::Passed, _) | (_, None) => String::new(),
                (_, Some(m)) => one_line(m, MESSAGE_WIDTH),
            };
            vec![
                status_label(s.status).to_string(),
                one_line(&s.name, MESSAGE_WIDTH),
                format!("{}/{}", passed_steps(s), s.steps.len()),
                fmt_ms(s.setup_ms),
                fmt_ms(s.duration_ms),
                message,
            ]
        }));
        let lines = align(&rows, &[false, false, true, true, true, false]);
        let (head, body) = lines.split_first().expect("the header row is there");
        writeln!(out, "{}", paint.apply(BOLD, head))?;
        for (line, s) in body.iter().zip(&r.scenarios) {
            // The status word starts the line: color just that.
            let label = status_label(s.status);
            let rest = &line[label.len()..];
            writeln!(out, "{}{rest}", paint.apply(status_color(s.status), label))?;
        }
    }

    for s in r.scenarios.iter().filter(|s| s.status == Status::Failed) {
        write_failure(out, s, paint)?;
    }

    writeln!(out)?;
    let count = |status: Status, word: &str, code: &str| {
        let n = r.scenarios.iter().filter(|s| s.status == status).count();
        let text = format!("{n} {word}");
        if n > 0 {
            paint.apply(code, &text)
        } else {
            text
        }
    };
    writeln!(
        out,
        "{}, {}, {} in {:.1}s (target {})",
        count(Status::Passed, "passed", GREEN),
        count(Status::Failed, "failed", RED),
        count(Status::Skipped, "skipped", YELLOW),
        r.duration_ms / 1000.0,
        printable(&r.target),
    )?;
    if let Some(ms) = r.max_overhead_ms() {
        writeln!(out, "max runner overhead per step: {}", fmt_ms(ms))?;
    }
    if !r.unreferenced_snapshots.is_empty() {
        let list = r.unreferenced_snapshots.join(", ");
        let line = format!(
            "unreferenced snapshots ({}): {}",
            r.unreferenced_snapshots.len(),
            printable(&list)
        );
        writeln!(out, "{}", paint.apply(YELLOW, &line))?;
    }
    Ok(())
}

/// The detail of one failed scenario: its failed steps, dump dir and diff.
fn write_failure(out: &mut String, s: &ScenarioReport, paint: Paint) -> fmt::Result {
    writeln!(out)?;
    let title = format!("{} {} ({})", status_label(s.status), s.name, s.file);
    writeln!(out, "{}", paint.apply(RED, &printable(&title)))?;
    let rows: Vec<Vec<String>> = s
        .steps
        .iter()
        .filter(|st| st.status == Status::Failed)
        .map(|st| {
            let failing: Vec<String> = st
                .budgets
                .iter()
                .filter(|b| !b.ok)
                .map(budget_text)
                .collect();
            let error = match (&st.error, failing.is_empty()) {
                (Some(e), _) => e.clone(),
                (None, false) => format!("budget {}", failing.join(", ")),
                (None, true) => "failed".to_string(),
            };
            [
                format!("step {}", st.index),
                st.kind.clone(),
                st.name.clone(),
                error,
            ]
            .iter()
            .map(|cell| printable(cell))
            .collect()
        })
        .collect();
    for line in align(&rows, &[false; 4]) {
        writeln!(out, "  {}", indent_continuation(&line, 6))?;
    }
    if let Some(dir) = &s.dump_dir {
        writeln!(out, "  dump: {}", printable(dir))?;
    }
    if let Some(diff) = &s.snapshot_diff {
        let snapshot = s.snapshot.as_deref().unwrap_or("snapshot");
        writeln!(out, "  {} differs:", printable(snapshot))?;
        for line in printable(diff).lines() {
            writeln!(out, "    {line}")?;
        }
    }
    Ok(())
}

/// A duration for people: `0.35ms`, `3.2ms`, `120ms`, `1.25s`, `12.5s`,
/// `2m05s`.
pub(crate) fn fmt_ms(ms: f64) -> String {
    if !ms.is_finite() {
        return "-".to_string();
    }
    let a = ms.abs();
    if a < 999.5 {
        let prec = match a {
            a if a < 1.0 => 2,
            a if a < 10.0 => 1,
            _ => 0,
        };
        format!("{}ms", trim_zeros(format!("{ms:.prec$}")))
    } else if a < 59_950.0 {
        let prec = if a < 9_995.0 { 2 } else { 1 };
        format!("{}s", trim_zeros(format!("{:.prec$}", ms / 1000.0)))
    } else {
        let secs = (a / 1000.0).round() as u64;
        let sign = if ms < 0.0 { "-" } else { "" };
        format!("{sign}{}m{:02}s", secs / 60, secs % 60)
    }
}

fn trim_zeros(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

pub(crate) fn status_label(s: Status) -> &'static str {
    match s {
        Status::Passed => "PASS",
        Status::Failed => "FAIL",
        Status::Skipped => "SKIP",
    }
}

/// The lowercase word (`passed`, ...), as in `report.json`.
pub(crate) fn status_word(s: Status) -> &'static str {
    match s {
        Status::Passed => "passed",
        Status::Failed => "failed",
        Status::Skipped => "skipped",
    }
}

pub(crate) fn passed_steps(s: &ScenarioReport) -> usize {
    s.steps
        .iter()
        .filter(|st| st.status == Status::Passed)
        .count()
}

/// `p95 120ms (limit 100ms)`.
pub(crate) fn budget_text(b: &BudgetCheck) -> String {
    format!(
        "{} {} (limit {})",
        b.kind,
        fmt_ms(b.actual_ms),
        fmt_ms(b.limit_ms)
    )
}

/// `s` on one line: whitespace runs become one space, control characters
/// go, and more than `max` characters end in `…`.
pub(crate) fn one_line(s: &str, max: usize) -> String {
    let flat = s
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace(char::is_control, "");
    if flat.chars().count() <= max {
        flat
    } else {
        let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
        cut.truncate(cut.trim_end().len());
        cut.push('…');
        cut
    }
}

/// `s` without the control characters a terminal would act on (escape
/// sequences, carriage returns); newlines and tabs stay.
fn printable(s: &str) -> String {
    s.chars()
        .filter(|&c| c == '\n' || c == '\t' || !c.is_control())
        .collect()
}

fn indent_continuation(s: &str, by: usize) -> String {
    s.replace('\n', &format!("\n{:by$}", ""))
}

/// Lays `rows` out in columns two spaces apart, each as wide as its widest
/// cell; `right` marks right-aligned columns. The last column is not padded,
/// and no line ends in spaces.
pub(crate) fn align(rows: &[Vec<String>], right: &[bool]) -> Vec<String> {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut widths = vec![0; cols];
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    rows.iter()
        .map(|row| {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                let pad = widths[i] - cell.chars().count();
                let last = i + 1 == row.len();
                match (right.get(i).copied().unwrap_or(false), last) {
                    (true, _) => line.extend(std::iter::repeat_n(' ', pad).chain(cell.chars())),
                    (false, true) => line.push_str(cell),
                    (false, false) => {
                        line.extend(cell.chars().chain(std::iter::repeat_n(' ', pad)))
                    }
                }
            }
            line.truncate(line.trim_end().len());
            line
        })
        .collect()
}

const BOLD: &str = "1";
const RED: &str = "31";
const GREEN: &str = "32";
const YELLOW: &str = "33";

fn status_color(s: Status) -> &'static str {
    match s {
        Status::Passed => GREEN,
        Status::Failed => RED,
        Status::Skipped => YELLOW,
    }
}

/// Plain ANSI colors, or none.
#[derive(Debug, Clone, Copy)]
struct Paint(bool);

impl Paint {
    fn apply(self, code: &str, s: &str) -> String {
        if self.0 {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::report::{PodResult, StepReport};

    fn step(index: &str, kind: &str, name: &str, status: Status, ms: f64) -> StepReport {
        StepReport {
            index: index.to_string(),
            name: name.to_string(),
            kind: kind.to_string(),
            status,
            error: None,
            duration_ms: ms,
            op_ms: ms * 0.8,
            overhead_ms: Some(ms * 0.2),
            budgets: Vec::new(),
            pods: Vec::new(),
            cpu_busy: None,
        }
    }

    fn pods(n: usize, failed: Option<usize>) -> Vec<PodResult> {
        (0..n)
            .map(|i| PodResult {
                pod: format!("pod-{i}"),
                ok: Some(i) != failed,
                duration_ms: 10.0 + i as f64,
                // Deliberately not in completion order.
                finished_at_ms: 50.0 - 3.0 * i as f64,
                exit_code: Some(if Some(i) == failed { 1 } else { 0 }),
                error: (Some(i) == failed).then(|| "exit 1: <boom> & \"x\"".to_string()),
                stdout: None,
            })
            .collect()
    }

    /// A passed scenario, a failed one (a failing budget, pods, a snapshot
    /// diff full of markup and a control character) and a skipped one.
    pub(crate) fn sample() -> RunReport {
        let mut put = step("2", "put", "write all", Status::Passed, 40.0);
        put.pods = pods(3, None);
        put.budgets.push(BudgetCheck {
            kind: "max".to_string(),
            limit_ms: 100.0,
            actual_ms: 40.0,
            ok: true,
        });
        let passed = ScenarioReport {
            name: "basic".to_string(),
            file: "scenarios/basic.yaml".to_string(),
            tags: vec!["smoke".to_string()],
            status: Status::Passed,
            message: None,
            setup_ms: 1200.0,
            pods: 3,
            duration_ms: 3400.0,
            steps: vec![step("1", "wait", "ready", Status::Passed, 5.0), put],
            snapshot: Some("scenarios/snapshots/basic.snap".to_string()),
            snapshot_diff: None,
            dump_dir: None,
        };

        let mut get = step("2.1", "get", "read <all> & \"more\"", Status::Failed, 150.0);
        get.pods = pods(4, Some(2));
        get.budgets.push(BudgetCheck {
            kind: "p95".to_string(),
            limit_ms: 100.0,
            actual_ms: 140.0,
            ok: false,
        });
        let mut parallel = step("2", "parallel", "", Status::Failed, 160.0);
        parallel.overhead_ms = None;
        parallel.error = Some("step 2.1 failed".to_string());
        let failed = ScenarioReport {
            name: "budget <&>\"'".to_string(),
            file: "scenarios/budget.yaml".to_string(),
            tags: Vec::new(),
            status: Status::Failed,
            message: Some("step 2.1 get: budget p95 140ms (limit 100ms)\nsecond line".to_string()),
            setup_ms: 900.0,
            pods: 4,
            duration_ms: 2100.0,
            steps: vec![
                step("1", "put", "seed", Status::Passed, 20.0),
                parallel,
                get,
                step("2.2", "list", "list", Status::Passed, 30.0),
                step("3", "get", "after", Status::Skipped, 0.0),
            ],
            snapshot: Some("scenarios/snapshots/budget.snap".to_string()),
            snapshot_diff: Some("-old <a> & \"b\" 'c'\u{1}\n+new </pre> ]]>".to_string()),
            dump_dir: Some("target/kt-scenario/run-1/budget".to_string()),
        };

        let skipped = ScenarioReport {
            name: "netns only".to_string(),
            file: "scenarios/netns.yaml".to_string(),
            tags: vec!["netns".to_string()],
            status: Status::Skipped,
            message: Some("needs the netns target".to_string()),
            setup_ms: 0.0,
            pods: 0,
            duration_ms: 0.0,
            steps: Vec::new(),
            snapshot: None,
            snapshot_diff: None,
            dump_dir: None,
        };

        RunReport {
            run_id: "run-1".to_string(),
            target: "local".to_string(),
            started_at: "2026-01-02T03:04:05Z".to_string(),
            duration_ms: 12_340.0,
            scenarios: vec![passed, failed, skipped],
            unreferenced_snapshots: vec!["scenarios/snapshots/stale.snap".to_string()],
        }
    }

    #[test]
    fn rows_and_totals() {
        let out = render(&sample(), false);
        assert!(!out.contains('\x1b'), "{out}");
        assert!(!out.contains('\u{1}'), "{out}");
        let rows: Vec<&str> = out.lines().skip(1).take(3).collect();
        assert!(rows[0].starts_with("PASS    basic  "), "{out}");
        assert!(rows[1].starts_with("FAIL    budget <&>\"'  "), "{out}");
        assert!(rows[2].starts_with("SKIP    netns only  "), "{out}");
        // Columns line up: every row has its steps column at one offset.
        let at: Vec<usize> = rows.iter().map(|l| l.find('/').unwrap()).collect();
        assert!(at.iter().all(|&a| a == at[0]), "{out}");
        assert!(rows[0].contains("2/2"), "{out}");
        assert!(rows[1].contains("2/5"), "{out}");
        // The message is one line in the table.
        assert!(rows[1].ends_with("(limit 100ms) second line"), "{out}");
        assert!(out.contains("1 passed, 1 failed, 1 skipped in 12.3s (target local)"));
        assert!(out.contains("max runner overhead per step: 30ms"), "{out}");
        assert!(out.contains("unreferenced snapshots (1): scenarios/snapshots/stale.snap"));
    }

    #[test]
    fn failure_detail() {
        let out = render(&sample(), false);
        assert!(out.contains("step 2    parallel"), "{out}");
        assert!(out.contains("step 2.1  get"), "{out}");
        assert!(out.contains("budget p95 140ms (limit 100ms)"), "{out}");
        assert!(!out.contains("step 2.2"), "{out}");
        assert!(
            out.contains("dump: target/kt-scenario/run-1/budget"),
            "{out}"
        );
        assert!(out.contains("    -old <a> & \"b\" 'c'\n    +new"), "{out}");
    }

    #[test]
    fn colors() {
        let out = render(&sample(), true);
        assert!(out.contains("\x1b[32mPASS\x1b[0m    basic"), "{out}");
        assert!(out.contains("\x1b[31mFAIL\x1b[0m"), "{out}");
        assert!(out.contains("\x1b[31m1 failed\x1b[0m"), "{out}");
    }

    #[test]
    fn long_messages_are_cut() {
        let s = one_line(&"word ".repeat(40), 20);
        assert_eq!(s.chars().count(), 20);
        assert!(s.ends_with("word…"), "{s}");
        assert_eq!(one_line("a\n\tb\u{7}c", 20), "a bc");
    }

    #[test]
    fn durations() {
        assert_eq!(fmt_ms(0.0), "0ms");
        assert_eq!(fmt_ms(0.35), "0.35ms");
        assert_eq!(fmt_ms(3.24), "3.2ms");
        assert_eq!(fmt_ms(120.4), "120ms");
        assert_eq!(fmt_ms(999.7), "1s");
        assert_eq!(fmt_ms(1250.0), "1.25s");
        assert_eq!(fmt_ms(12_345.0), "12.3s");
        assert_eq!(fmt_ms(125_000.0), "2m05s");
        assert_eq!(fmt_ms(f64::NAN), "-");
    }
}
