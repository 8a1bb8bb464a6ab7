//! One self-contained HTML page: no scripts, no external assets, inline CSS
//! and SVG plots drawn here (step durations with budget limits, per-pod
//! completion times). Hover titles carry the exact numbers.

use std::fmt::{self, Write as _};

use super::junit::escape as esc;
use super::terminal::{budget_text, fmt_ms, one_line, passed_steps, status_label, status_word};
use super::{PodResult, RunReport, ScenarioReport, Status, StepReport};

pub fn render(r: &RunReport) -> String {
    let mut h = String::with_capacity(32 * 1024);
    write_page(&mut h, r).expect("writing to a String cannot fail");
    h
}

const CSS: &str = "\
:root{--line:#d0d7de;--muted:#57606a}
*{box-sizing:border-box}
body{margin:0;padding:24px;background:#f6f8fa;color:#1f2328;font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif}
main{max-width:960px;margin:0 auto}
header,section{background:#fff;border:1px solid var(--line);border-radius:8px;padding:14px 20px;margin-bottom:16px}
h1{font-size:20px;margin:0 0 4px}
h2{font-size:16px;margin:0 0 4px}
h3{font-size:12px;margin:16px 0 6px;color:var(--muted);text-transform:uppercase;letter-spacing:.04em}
a{color:#0969da;text-decoration:none}
code,pre,svg text{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
code,pre{font-size:12px}
.meta{color:var(--muted);margin:2px 0}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th{font-size:12px;font-weight:600;color:var(--muted)}
.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
.badge{display:inline-block;min-width:44px;padding:1px 7px;border-radius:10px;color:#fff;font-size:11px;font-weight:700;text-align:center}
.badge.passed{background:#1a7f37}.badge.failed{background:#cf222e}.badge.skipped{background:#9a6700}.badge.zero{background:#8c959f}
.msg{margin:8px 0;padding:8px 12px;border-radius:6px;white-space:pre-wrap;background:#ffebe9;border:1px solid #ffcecb}
.msg.skipped{background:#fff8c5;border-color:#eedc82}
ul.failed{margin:4px 0;padding-left:20px}
pre{margin:0;padding:8px 12px;overflow:auto;background:#f6f8fa;border:1px solid var(--line);border-radius:6px}
.add{color:#116329;background:#dafbe1}.del{color:#a40e26;background:#ffebe9}
.legend{font-size:12px;color:var(--muted);margin:0 0 4px}
.legend i{display:inline-block;width:12px;height:10px;margin:0 4px 0 12px;border-radius:2px;vertical-align:-1px}
.legend i:first-child{margin-left:0}
svg{display:block;max-width:100%;height:auto}
svg text{font-size:11px;fill:#1f2328}
svg .tick{font-size:10px;fill:#57606a}
svg .grid{stroke:#eaeef2;stroke-width:1}
";

/// The width of every plot (its view box; it scales down with the page).
const CHART_W: f64 = 900.0;
/// The advance of one 11px monospace character.
const CHAR_W: f64 = 6.6;
const BUDGET_OK: &str = "#24292f";
const BUDGET_FAILED: &str = "#82071e";

fn write_page(h: &mut String, r: &RunReport) -> fmt::Result {
    let skipped = r
        .scenarios
        .iter()
        .filter(|s| s.status == Status::Skipped)
        .count();
    writeln!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"/>"
    )?;
    writeln!(
        h,
        "<title>kt-scenario · {} · {}</title>\n<style>\n{CSS}</style>\n</head>\n<body>\n<main>",
        esc(&r.target),
        esc(&r.run_id)
    )?;

    writeln!(h, "<header>\n<h1>kt-scenario report</h1>")?;
    writeln!(
        h,
        "<p class=\"meta\">run <code>{}</code> · target <b>{}</b> · started {} · took {}</p>",
        esc(&r.run_id),
        esc(&r.target),
        esc(&r.started_at),
        fmt_ms(r.duration_ms)
    )?;
    write!(h, "<p>")?;
    for (status, n) in [
        (Status::Passed, r.passed()),
        (Status::Failed, r.failed()),
        (Status::Skipped, skipped),
    ] {
        let word = status_word(status);
        let class = if n == 0 { "zero" } else { word };
        write!(h, "<span class=\"badge {class}\">{n} {word}</span> ")?;
    }
    writeln!(h, "</p>")?;
    if let Some(ms) = r.max_overhead_ms() {
        writeln!(
            h,
            "<p class=\"meta\">max runner overhead per step: {}</p>",
            fmt_ms(ms)
        )?;
    }
    if !r.unreferenced_snapshots.is_empty() {
        writeln!(h, "<p class=\"msg skipped\">unreferenced snapshots:")?;
        for snap in &r.unreferenced_snapshots {
            write!(h, "\n<code>{}</code>", esc(snap))?;
        }
        writeln!(h, "</p>")?;
    }
    writeln!(h, "</header>")?;

    if !r.scenarios.is_empty() {
        write_summary(h, &r.scenarios)?;
    }
    for (i, s) in r.scenarios.iter().enumerate() {
        write_scenario(h, i, s)?;
    }
    writeln!(h, "</main>\n</body>\n</html>")
}

fn badge(status: Status) -> String {
    format!(
        "<span class=\"badge {}\">{}</span>",
        status_word(status),
        status_label(status)
    )
}

fn write_summary(h: &mut String, scenarios: &[ScenarioReport]) -> fmt::Result {
    writeln!(
        h,
        "<section>\n<table>\n<thead><tr><th>status</th><th>scenario</th><th class=\"num\">steps</th>\
         <th class=\"num\">pods</th><th class=\"num\">setup</th><th class=\"num\">duration</th>\
         <th>message</th></tr></thead>\n<tbody>"
    )?;
    for (i, s) in scenarios.iter().enumerate() {
        let message = match (s.status, &s.message) {
            (Status::Passed, _) | (_, None) => String::new(),
            (_, Some(m)) => one_line(m, 120),
        };
        writeln!(
            h,
            "<tr><td>{}</td><td><a href=\"#s{i}\">{}</a></td><td class=\"num\">{}/{}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
            badge(s.status),
            esc(&s.name),
            passed_steps(s),
            s.steps.len(),
            s.pods,
            fmt_ms(s.setup_ms),
            fmt_ms(s.duration_ms),
            esc(&message),
        )?;
    }
    writeln!(h, "</tbody>\n</table>\n</section>")
}

fn step_label(st: &StepReport) -> String {
    format!("{} {} {}", st.index, st.kind, st.name)
}

fn write_scenario(h: &mut String, i: usize, s: &ScenarioReport) -> fmt::Result {
    writeln!(h, "<section id=\"s{i}\">")?;
    writeln!(h, "<h2>{} {}</h2>", badge(s.status), esc(&s.name))?;
    let mut meta = vec![format!("<code>{}</code>", esc(&s.file))];
    if !s.tags.is_empty() {
        meta.push(format!("tags {}", esc(&s.tags.join(", "))));
    }
    meta.push(format!("{} pods", s.pods));
    meta.push(format!("setup {}", fmt_ms(s.setup_ms)));
    meta.push(format!("ran {}", fmt_ms(s.duration_ms)));
    if let Some(snap) = &s.snapshot {
        meta.push(format!("snapshot <code>{}</code>", esc(snap)));
    }
    writeln!(h, "<p class=\"meta\">{}</p>", meta.join(" · "))?;

    if let (Status::Failed | Status::Skipped, Some(m)) = (s.status, &s.message) {
        writeln!(
            h,
            "<p class=\"msg {}\">{}</p>",
            status_word(s.status),
            esc(m)
        )?;
    }
    let failed: Vec<&StepReport> = s
        .steps
        .iter()
        .filter(|st| st.status == Status::Failed)
        .collect();
    if !failed.is_empty() {
        writeln!(h, "<h3>Failed steps</h3>\n<ul class=\"failed\">")?;
        for st in failed {
            let mut why: Vec<String> = st.error.iter().cloned().collect();
            why.extend(
                st.budgets
                    .iter()
                    .filter(|b| !b.ok)
                    .map(|b| format!("budget {}", budget_text(b))),
            );
            writeln!(
                h,
                "<li><code>{}</code> {}</li>",
                esc(&step_label(st)),
                esc(&why.join("; "))
            )?;
        }
        writeln!(h, "</ul>")?;
    }

    if !s.steps.is_empty() {
        let (light, dark) = palette(Status::Passed);
        let (_, failed) = palette(Status::Failed);
        writeln!(
            h,
            "<h3>Steps</h3>\n<p class=\"legend\"><i style=\"background:{light}\"></i>step wall time\
             <i style=\"background:{dark}\"></i>operations<i style=\"background:{BUDGET_OK};width:2px\"></i>\
             budget limit<i style=\"background:{failed}\"></i>failed</p>"
        )?;
        step_chart(h, &s.steps)?;
    }
    for st in s.steps.iter().filter(|st| st.pods.len() >= 2) {
        let bad = st.pods.iter().filter(|p| !p.ok).count();
        writeln!(
            h,
            "<h3>Pods · step {} · {} pods{}</h3>",
            esc(&step_label(st)),
            st.pods.len(),
            if bad > 0 {
                format!(", {bad} failed")
            } else {
                String::new()
            }
        )?;
        pod_chart(h, &st.pods)?;
    }

    if let Some(diff) = &s.snapshot_diff {
        writeln!(h, "<h3>Snapshot diff</h3>\n<pre>{}</pre>", diff_html(diff))?;
    }
    if let Some(dir) = &s.dump_dir {
        writeln!(h, "<p class=\"meta\">dump <code>{}</code></p>", esc(dir))?;
    }
    writeln!(h, "</section>")
}

/// A diff with its added and removed lines colored.
fn diff_html(diff: &str) -> String {
    diff.lines()
        .map(|line| match line.chars().next() {
            Some('+') => format!("<span class=\"add\">{}</span>", esc(line)),
            Some('-') => format!("<span class=\"del\">{}</span>", esc(line)),
            _ => esc(line),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// (bar, inner segment / dot) colors for a status.
fn palette(status: Status) -> (&'static str, &'static str) {
    match status {
        Status::Passed => ("#b6d4f2", "#2f6fb3"),
        Status::Failed => ("#f6b9b5", "#cf222e"),
        Status::Skipped => ("#e1e4e8", "#8c959f"),
    }
}

fn open_svg(h: &mut String, height: f64, label: &str) -> fmt::Result {
    writeln!(
        h,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {CHART_W} {height:.0}\" \
         width=\"{CHART_W}\" height=\"{height:.0}\" role=\"img\" aria-label=\"{label}\">"
    )
}

/// Horizontal bars, one row per step: wall time, the operations' share of it
/// darker inside, a marker per budget limit.
fn step_chart(h: &mut String, steps: &[StepReport]) -> fmt::Result {
    const ROW: f64 = 20.0;
    const BAR: f64 = 14.0;
    const TOP: f64 = 4.0;
    const AXIS: f64 = 20.0;
    const VALUE_W: f64 = 60.0;
    let labels: Vec<(f64, String)> = steps
        .iter()
        .map(|st| {
            let indent = st.index.matches('.').count() as f64 * 2.0 * CHAR_W;
            (indent, one_line(&step_label(st), 40))
        })
        .collect();
    let label_w = labels
        .iter()
        .map(|(indent, l)| indent + l.chars().count() as f64 * CHAR_W)
        .fold(0.0, f64::max)
        .clamp(80.0, 320.0)
        + 20.0;
    let x0 = label_w;
    let max = steps
        .iter()
        .flat_map(|st| {
            let limits = st.budgets.iter().map(|b| b.limit_ms);
            [st.duration_ms, st.op_ms].into_iter().chain(limits)
        })
        .fold(0.0, f64::max);
    let scale = Scale::new(max, CHART_W - x0 - VALUE_W);
    let bottom = TOP + ROW * steps.len() as f64;
    open_svg(h, bottom + AXIS, "step durations")?;
    for t in scale.ticks() {
        let x = x0 + scale.at(t);
        writeln!(
            h,
            "<line class=\"grid\" x1=\"{x:.1}\" y1=\"{TOP}\" x2=\"{x:.1}\" y2=\"{bottom:.1}\"/>\
             <text class=\"tick\" x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            bottom + 14.0,
            fmt_ms(t)
        )?;
    }
    for (i, (st, (indent, label))) in steps.iter().zip(&labels).enumerate() {
        let y = TOP + ROW * i as f64;
        let (light, dark) = palette(st.status);
        let mut title = format!(
            "{}: {}, {} (operations {}",
            step_label(st),
            status_word(st.status),
            fmt_ms(st.duration_ms),
            fmt_ms(st.op_ms)
        );
        if let Some(o) = st.overhead_ms {
            let _ = write!(title, ", overhead {}", fmt_ms(o));
        }
        if let Some(busy) = st.cpu_busy {
            let _ = write!(title, ", cpu {:.0}% busy", busy * 100.0);
        }
        title.push(')');
        if let Some(e) = &st.error {
            let _ = write!(title, "\n{e}");
        }
        writeln!(h, "<g><title>{}</title>", esc(&title))?;
        writeln!(
            h,
            "<text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            4.0 + indent,
            y + ROW / 2.0 + 4.0,
            esc(label)
        )?;
        let w = scale.at(st.duration_ms);
        writeln!(
            h,
            "<rect x=\"{x0:.1}\" y=\"{:.1}\" width=\"{w:.1}\" height=\"{BAR}\" rx=\"2\" fill=\"{light}\"/>\
             <rect x=\"{x0:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{dark}\"/>",
            y + (ROW - BAR) / 2.0,
            y + ROW / 2.0 - BAR / 4.0,
            scale.at(st.op_ms),
            BAR / 2.0
        )?;
        for b in &st.budgets {
            let x = x0 + scale.at(b.limit_ms);
            let color = if b.ok { BUDGET_OK } else { BUDGET_FAILED };
            writeln!(
                h,
                "<line x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"{color}\" stroke-width=\"2\">\
                 <title>budget {}{}</title></line>",
                y + 1.0,
                y + ROW - 1.0,
                esc(&budget_text(b)),
                if b.ok { "" } else { ": exceeded" }
            )?;
        }
        let value = match st.status {
            Status::Skipped => "skipped".to_string(),
            _ => fmt_ms(st.duration_ms),
        };
        writeln!(
            h,
            "<text class=\"tick\" x=\"{:.1}\" y=\"{:.1}\">{value}</text>\n</g>",
            x0 + w + 4.0,
            y + ROW / 2.0 + 3.5
        )?;
    }
    writeln!(h, "</svg>")
}

/// One column per pod, sorted by completion: a bar over the pod's run
/// (finish minus duration to finish), a dot at its finish, and the p50/p95
/// of the finishes as dashed lines.
fn pod_chart(h: &mut String, pods: &[PodResult]) -> fmt::Result {
    const TOP: f64 = 10.0;
    const PLOT_H: f64 = 140.0;
    const LEFT: f64 = 60.0;
    const RIGHT: f64 = 90.0;
    const BOTTOM: f64 = 36.0;
    let mut pods: Vec<&PodResult> = pods.iter().collect();
    pods.sort_by(|a, b| a.finished_at_ms.total_cmp(&b.finished_at_ms));
    let finishes: Vec<f64> = pods.iter().map(|p| p.finished_at_ms).collect();
    let scale = Scale::new(finishes.iter().copied().fold(0.0, f64::max), PLOT_H);
    let plot_w = CHART_W - LEFT - RIGHT;
    let base = TOP + PLOT_H;
    let y = |v: f64| base - scale.at(v);
    open_svg(h, base + BOTTOM, "pod completion times")?;
    for t in scale.ticks() {
        writeln!(
            h,
            "<line class=\"grid\" x1=\"{LEFT}\" y1=\"{0:.1}\" x2=\"{1:.1}\" y2=\"{0:.1}\"/>\
             <text class=\"tick\" x=\"{2:.1}\" y=\"{3:.1}\" text-anchor=\"end\">{4}</text>",
            y(t),
            LEFT + plot_w,
            LEFT - 6.0,
            y(t) + 3.5,
            fmt_ms(t)
        )?;
    }
    let slot = plot_w / pods.len() as f64;
    let bar_w = (slot * 0.6).clamp(1.0, 16.0);
    let dot = (slot * 0.35).clamp(1.2, 3.5);
    let names_fit = pods.len() <= 20;
    for (i, p) in pods.iter().enumerate() {
        let cx = LEFT + slot * (i as f64 + 0.5);
        let (light, dark) = palette(if p.ok { Status::Passed } else { Status::Failed });
        let start = (p.finished_at_ms - p.duration_ms).max(0.0);
        let mut title = format!(
            "{}: finished at {}, ran {}",
            p.pod,
            fmt_ms(p.finished_at_ms),
            fmt_ms(p.duration_ms)
        );
        if let Some(code) = p.exit_code {
            let _ = write!(title, ", exit {code}");
        }
        if let Some(e) = &p.error {
            let _ = write!(title, "\n{e}");
        }
        writeln!(
            h,
            "<g><title>{}</title><rect x=\"{:.1}\" y=\"{:.1}\" width=\"{bar_w:.1}\" height=\"{:.1}\" fill=\"{light}\"/>\
             <circle cx=\"{cx:.1}\" cy=\"{:.1}\" r=\"{dot:.1}\" fill=\"{dark}\"/></g>",
            esc(&title),
            cx - bar_w / 2.0,
            y(p.finished_at_ms),
            (y(start) - y(p.finished_at_ms)).max(0.5),
            y(p.finished_at_ms),
        )?;
        if names_fit {
            let chars = ((slot - 4.0) / (CHAR_W * 10.0 / 11.0)).floor().max(1.0) as usize;
            writeln!(
                h,
                "<text class=\"tick\" x=\"{cx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                base + 13.0,
                esc(&one_line(&p.pod, chars))
            )?;
        }
    }
    writeln!(
        h,
        "<text class=\"tick\" x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{} pods by completion time; \
         bar: the pod's run, dot: its finish</text>",
        LEFT + plot_w / 2.0,
        base + 30.0,
        pods.len()
    )?;

    // No pods finished: both lines at 0.
    let at = |p| kt_types::stats::percentile(&finishes, p).unwrap_or(0.0);
    let (p50, p95) = (at(50.0), at(95.0));
    let (y50, y95) = (y(p50), y(p95));
    // Labels sit on their lines unless they would overlap.
    let (mut l50, mut l95) = (y50 + 3.5, y95 + 3.5);
    if l50 - l95 < 12.0 {
        let mid = (l50 + l95) / 2.0;
        (l50, l95) = (mid + 6.0, mid - 6.0);
    }
    for (name, v, line_y, label_y, color) in [
        ("p50", p50, y50, l50, "#6e7781"),
        ("p95", p95, y95, l95, "#bc4c00"),
    ] {
        writeln!(
            h,
            "<line x1=\"{LEFT}\" y1=\"{line_y:.1}\" x2=\"{:.1}\" y2=\"{line_y:.1}\" stroke=\"{color}\" \
             stroke-dasharray=\"4 3\"/><text x=\"{:.1}\" y=\"{label_y:.1}\" \
             style=\"fill:{color}\">{name} {}</text>",
            LEFT + plot_w,
            LEFT + plot_w + 6.0,
            fmt_ms(v)
        )?;
    }
    writeln!(h, "</svg>")
}

/// A linear axis from 0 to a round maximum, ticks at 1, 2 or 5 × 10ⁿ.
#[derive(Debug, Clone, Copy)]
struct Scale {
    max: f64,
    step: f64,
    /// Pixels from 0 to `max`.
    len: f64,
}

impl Scale {
    fn new(max: f64, len: f64) -> Scale {
        let max = if max.is_finite() && max > 0.0 {
            max
        } else {
            1.0
        };
        let rough = max / 4.0;
        let magnitude = 10f64.powf(rough.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0]
            .into_iter()
            .map(|m| m * magnitude)
            .find(|&s| s >= rough)
            .unwrap_or(10.0 * magnitude);
        let steps = (max / step - 1e-9).ceil().max(1.0);
        Scale {
            max: steps * step,
            step,
            len,
        }
    }

    /// Pixels from 0 to `v`, clamped to the axis.
    fn at(self, v: f64) -> f64 {
        if v.is_finite() {
            (v / self.max).clamp(0.0, 1.0) * self.len
        } else {
            0.0
        }
    }

    fn ticks(self) -> impl Iterator<Item = f64> {
        let n = (self.max / self.step).round() as usize;
        (0..=n).map(move |i| i as f64 * self.step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::junit::tests::check_xml;
    use crate::report::terminal::tests::sample;

    #[test]
    fn one_plot_per_chart() {
        let page = render(&sample());
        // Two scenarios with steps, two steps with 2+ pods.
        assert_eq!(page.matches("<svg").count(), 4, "{page}");
        assert_eq!(page.matches("</svg>").count(), 4);
        assert_eq!(page.matches("<section id=").count(), 3);
        // One budget marker each, the failing one red.
        assert_eq!(page.matches("stroke-width=\"2\"").count(), 2);
        assert!(page.contains(&format!("stroke=\"{BUDGET_FAILED}\" stroke-width=\"2\"><title>budget p95 140ms (limit 100ms): exceeded")));
        // Pods are drawn in completion order.
        let failed = &page[page.find("<section id=\"s1\">").unwrap()..];
        let first = failed.find(">pod-3</text>").unwrap();
        let last = failed.find(">pod-0</text>").unwrap();
        assert!(first < last);
        assert!(page.contains(">p50 "));
        assert!(page.contains(">p95 "));
        assert!(!page.contains("<script"));
        assert!(!page.contains("src=") && !page.contains("<link"));
    }

    #[test]
    fn everything_is_escaped() {
        let page = render(&sample());
        check_xml(&page).unwrap_or_else(|e| panic!("{e}\n{page}"));
        assert!(!page.contains('\u{1}'));
        assert!(!page.contains("budget <&>"));
        assert!(page.contains("budget &lt;&amp;&gt;&quot;&apos;"));
        assert!(page.contains(
            "<span class=\"del\">-old &lt;a&gt; &amp; &quot;b&quot; &apos;c&apos;</span>\n\
             <span class=\"add\">+new &lt;/pre&gt; ]]&gt;</span>"
        ));
        assert!(page.contains("read &lt;all&gt; &amp; &quot;more&quot;"));
        assert!(page.contains("<code>target/kt-scenario/run-1/budget</code>"));
        assert!(page.contains("<code>scenarios/snapshots/stale.snap</code>"));
    }

    #[test]
    fn scales() {
        let s = Scale::new(40.0, 100.0);
        assert_eq!(s.ticks().collect::<Vec<_>>(), [0.0, 10.0, 20.0, 30.0, 40.0]);
        let s = Scale::new(1300.0, 100.0);
        assert_eq!(s.max, 1500.0);
        assert_eq!(s.at(750.0), 50.0);
        assert_eq!(s.at(9e9), 100.0);
        assert_eq!(Scale::new(0.0, 10.0).max, 1.0);
    }
}
