//! JUnit XML for CI: one test suite, one test case per scenario. Also the
//! XML/HTML escaping the HTML page shares.

use std::fmt::{self, Write as _};

use super::terminal::{align, budget_text, fmt_ms, status_word};
use super::{RunReport, ScenarioReport, Status, StepReport};

pub fn render(r: &RunReport) -> String {
    let mut out = String::new();
    write_report(&mut out, r).expect("writing to a String cannot fail");
    out
}

fn write_report(x: &mut String, r: &RunReport) -> fmt::Result {
    // Unreferenced snapshots fail the run, so they are a failing test case
    // too (a CI view must not be green while the run exits 1).
    let orphans = !r.unreferenced_snapshots.is_empty();
    let tests = r.scenarios.len() + usize::from(orphans);
    let failures = r.failed() + usize::from(orphans);
    let skipped = r
        .scenarios
        .iter()
        .filter(|s| s.status == Status::Skipped)
        .count();
    let counts = format!(
        r#"tests="{tests}" failures="{failures}" errors="0" skipped="{skipped}" time="{}""#,
        secs(r.duration_ms)
    );
    writeln!(x, r#"<?xml version="1.0" encoding="UTF-8"?>"#)?;
    writeln!(x, r#"<testsuites name="kt-scenario" {counts}>"#)?;
    writeln!(
        x,
        r#"  <testsuite name="{}" {counts} timestamp="{}">"#,
        escape_attr(&format!("kt-scenario ({})", r.target)),
        escape_attr(&r.started_at),
    )?;
    writeln!(x, "    <properties>")?;
    for (name, value) in [("run_id", &r.run_id), ("target", &r.target)] {
        writeln!(
            x,
            r#"      <property name="{name}" value="{}"/>"#,
            escape_attr(value)
        )?;
    }
    writeln!(x, "    </properties>")?;
    for s in &r.scenarios {
        write_case(x, s)?;
    }
    if orphans {
        let list = r.unreferenced_snapshots.join("\n");
        writeln!(
            x,
            r#"    <testcase classname="scenarios" name="unreferenced snapshots" time="0"><failure message="{}">{}</failure></testcase>"#,
            escape_attr(&format!(
                "{} snapshot file(s) belong to no scenario; remove them or run with --accept",
                r.unreferenced_snapshots.len()
            )),
            escape(&list)
        )?;
        writeln!(
            x,
            "    <system-out>unreferenced snapshots:\n{}</system-out>",
            escape(&list)
        )?;
    }
    writeln!(x, "  </testsuite>")?;
    writeln!(x, "</testsuites>")
}

fn write_case(x: &mut String, s: &ScenarioReport) -> fmt::Result {
    write!(
        x,
        r#"    <testcase classname="scenarios" name="{}" file="{}" time="{}""#,
        escape_attr(&s.name),
        escape_attr(&s.file),
        secs(s.duration_ms),
    )?;
    if s.status == Status::Passed && s.steps.is_empty() {
        return writeln!(x, "/>");
    }
    writeln!(x, ">")?;
    let message = s.message.as_deref().unwrap_or_default();
    match s.status {
        Status::Passed => {}
        Status::Skipped => {
            writeln!(x, r#"      <skipped message="{}"/>"#, escape_attr(message))?;
        }
        Status::Failed => {
            let mut body = format!("{message}\n\nsteps:\n{}", steps_text(&s.steps));
            if let Some(diff) = &s.snapshot_diff {
                let snapshot = s.snapshot.as_deref().unwrap_or("snapshot");
                write!(body, "\n{snapshot} differs:\n{diff}\n")?;
            }
            if let Some(dir) = &s.dump_dir {
                write!(body, "\ndump: {dir}\n")?;
            }
            let message = if message.is_empty() {
                "failed"
            } else {
                message
            };
            writeln!(
                x,
                r#"      <failure message="{}" type="failure">{}</failure>"#,
                escape_attr(message),
                escape(&body),
            )?;
        }
    }
    if !s.steps.is_empty() {
        writeln!(
            x,
            "      <system-out>{}</system-out>",
            escape(&steps_text(&s.steps))
        )?;
    }
    writeln!(x, "    </testcase>")
}

/// The steps as aligned text: index, kind, name, status, duration, error;
/// under each its budget checks and failed pods.
fn steps_text(steps: &[StepReport]) -> String {
    let mut out = String::new();
    let rows: Vec<Vec<String>> = steps
        .iter()
        .map(|st| {
            vec![
                st.index.clone(),
                st.kind.clone(),
                st.name.clone(),
                status_word(st.status).to_string(),
                fmt_ms(st.duration_ms),
                st.error.clone().unwrap_or_default(),
            ]
        })
        .collect();
    let right = [false, false, false, false, true, false];
    for (line, st) in align(&rows, &right).iter().zip(steps) {
        out.push_str(line);
        out.push('\n');
        for b in &st.budgets {
            let verdict = if b.ok { "ok" } else { "FAILED" };
            let _ = writeln!(out, "    budget {}: {verdict}", budget_text(b));
        }
        for p in st.pods.iter().filter(|p| !p.ok) {
            let exit = p
                .exit_code
                .map(|c| format!(", exit {c}"))
                .unwrap_or_default();
            let error = p
                .error
                .as_ref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default();
            let _ = writeln!(out, "    pod {} failed{exit}{error}", p.pod);
        }
    }
    out
}

/// Seconds, as JUnit wants them.
fn secs(ms: f64) -> String {
    format!("{:.3}", if ms.is_finite() { ms / 1000.0 } else { 0.0 })
}

/// `s` as XML (and HTML) text: `&<>"'` escaped, and the characters XML 1.0
/// forbids (most C0 controls, U+FFFE, U+FFFF) dropped.
pub(crate) fn escape(s: &str) -> String {
    escape_as(s, false)
}

/// Like [`escape`], for an attribute value: newlines and tabs become
/// character references, as a parser would otherwise fold them to spaces.
pub(crate) fn escape_attr(s: &str) -> String {
    escape_as(s, true)
}

fn escape_as(s: &str, attribute: bool) -> String {
    let mut out = String::with_capacity(s.len() + s.len() / 8);
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' if attribute => {
                let _ = write!(out, "&#{};", u32::from(c));
            }
            c if forbidden_in_xml(c) => {}
            c => out.push(c),
        }
    }
    out
}

fn forbidden_in_xml(c: char) -> bool {
    matches!(c, '\0'..='\u{8}' | '\u{b}' | '\u{c}' | '\u{e}'..='\u{1f}' | '\u{fffe}' | '\u{ffff}')
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::report::terminal::tests::sample;

    /// A small well-formedness check: tags nest and close, attribute values
    /// are quoted and hold no raw `<`, every `&` starts a known reference,
    /// and no character XML forbids appears. `<!...>` and `<?...?>` are
    /// skipped whole.
    pub(crate) fn check_xml(doc: &str) -> Result<(), String> {
        let mut open: Vec<&str> = Vec::new();
        let mut rest = doc;
        while let Some(lt) = rest.find('<') {
            check_text(&rest[..lt])?;
            let tag_src = &rest[lt + 1..];
            if tag_src.starts_with('!') || tag_src.starts_with('?') {
                let end = tag_src.find('>').ok_or("unterminated declaration")?;
                rest = &tag_src[end + 1..];
                continue;
            }
            let mut quote = None;
            let mut end = None;
            for (i, c) in tag_src.char_indices() {
                match (quote, c) {
                    (Some(q), c) if c == q => quote = None,
                    (Some(_), '<') => return Err(format!("raw < in an attribute: {tag_src:.60}")),
                    (Some(_), _) => {}
                    (None, '"' | '\'') => quote = Some(c),
                    (None, '<') => return Err(format!("< inside a tag: {tag_src:.60}")),
                    (None, '>') => {
                        end = Some(i);
                        break;
                    }
                    (None, _) => {}
                }
            }
            let end = end.ok_or("unterminated tag")?;
            let tag = &tag_src[..end];
            check_text(tag)?;
            if let Some(closing) = tag.strip_prefix('/') {
                let expected = open.pop().ok_or(format!("</{closing}> closes nothing"))?;
                if tag_name(closing) != expected {
                    return Err(format!("</{closing}> closes <{expected}>"));
                }
            } else if !tag.ends_with('/') {
                open.push(tag_name(tag));
            }
            rest = &tag_src[end + 1..];
        }
        check_text(rest)?;
        match open.pop() {
            Some(unclosed) => Err(format!("<{unclosed}> is never closed")),
            None => Ok(()),
        }
    }

    fn tag_name(tag: &str) -> &str {
        tag.split(|c: char| c.is_whitespace() || c == '/')
            .next()
            .unwrap_or_default()
    }

    fn check_text(text: &str) -> Result<(), String> {
        if let Some(c) = text.chars().find(|&c| forbidden_in_xml(c)) {
            return Err(format!("forbidden character {c:?}"));
        }
        for (i, _) in text.match_indices('&') {
            let reference = text[i + 1..].split(';').next().unwrap_or_default();
            let known = matches!(reference, "amp" | "lt" | "gt" | "quot" | "apos")
                || reference
                    .strip_prefix('#')
                    .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
            if !known || !text[i..].contains(';') {
                return Err(format!("bad reference at {:.20}", &text[i..]));
            }
        }
        Ok(())
    }

    #[test]
    fn well_formed_with_counts() {
        let xml = render(&sample());
        check_xml(&xml).unwrap_or_else(|e| panic!("{e}\n{xml}"));
        assert!(xml.contains(
            r#"<testsuite name="kt-scenario (local)" tests="4" failures="2" errors="0" skipped="1" time="12.340""#
        ));
        // Three scenarios, and the unreferenced snapshots as a failing case.
        assert_eq!(xml.matches("<testcase ").count(), 4);
        assert_eq!(xml.matches("<failure ").count(), 2);
        assert!(xml.contains(r#"name="unreferenced snapshots""#));
        assert_eq!(xml.matches("<skipped ").count(), 1);
        assert!(xml.contains(r#"name="basic" file="scenarios/basic.yaml" time="3.400""#));
        assert!(xml.contains(r#"<skipped message="needs the netns target"/>"#));
    }

    #[test]
    fn escaping() {
        let xml = render(&sample());
        assert!(!xml.contains('\u{1}'));
        assert!(
            xml.contains(r#"name="budget &lt;&amp;&gt;&quot;&apos;""#),
            "{xml}"
        );
        // A multi-line message keeps its newline inside the attribute.
        assert!(xml.contains("(limit 100ms)&#10;second line\""), "{xml}");
        // The diff is in the failure body, escaped, minus the control char.
        assert!(xml.contains(
            "-old &lt;a&gt; &amp; &quot;b&quot; &apos;c&apos;\n+new &lt;/pre&gt; ]]&gt;"
        ));
        assert!(xml.contains("budget p95 140ms (limit 100ms): FAILED"));
        assert!(xml.contains("pod pod-2 failed, exit 1: exit 1: &lt;boom&gt;"));
        assert_eq!(escape("a\u{0}b\u{b}c\td\u{fffe}"), "abc\td");
        assert_eq!(escape_attr("a\tb\r\nc"), "a&#9;b&#13;&#10;c");
    }

    #[test]
    fn checker_catches_breakage() {
        assert!(check_xml("<a b=\"<\"/>").is_err());
        assert!(check_xml("<a>&</a>").is_err());
        assert!(check_xml("<a><b></a>").is_err());
        assert!(check_xml("<a>\u{1}</a>").is_err());
        assert!(check_xml("<a b='x &amp; y'>&#10;</a>").is_ok());
    }
}
