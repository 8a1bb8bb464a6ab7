//! OpenMetrics text to the Prometheus text format (0.0.4).
//!
//! prometheus-client writes OpenMetrics, whose HELP and TYPE lines name a
//! counter without its `_total` suffix (`# HELP kt_bytes_sent ...` over
//! `kt_bytes_sent_total 3`). A Prometheus text parser (promtool, a scraper
//! that does not ask for OpenMetrics) then finds samples with no help. This
//! renames a counter's and an info's metadata lines to their samples' names
//! and drops what the older format lacks (`# UNIT`, `# EOF`); sample lines
//! are the same in both formats.

use std::collections::HashMap;

/// The Prometheus text format of an OpenMetrics exposition.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    // The type of each family, from its TYPE line (which follows its HELP).
    let types: HashMap<&str, &str> = openmetrics
        .lines()
        .filter_map(|l| {
            let mut parts = l.strip_prefix("# TYPE ")?.splitn(2, ' ');
            Some((parts.next()?, parts.next()?))
        })
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            let renamed = sample_name(name, types.get(name).copied());
            out.push_str(&format!("# HELP {renamed} {help}\n"));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let renamed = sample_name(name, Some(kind));
            let kind = match kind {
                "info" | "stateset" => "gauge",
                "unknown" | "gaugehistogram" => "untyped",
                k => k,
            };
            out.push_str(&format!("# TYPE {renamed} {kind}\n"));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The name a family's samples carry in the Prometheus text format.
fn sample_name(family: &str, kind: Option<&str>) -> String {
    match kind {
        Some("counter") => format!("{family}_total"),
        Some("info") => format!("{family}_info"),
        _ => family.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_infos_are_described_by_their_sample_names() {
        let om = "# HELP kt_bytes_sent File content bytes sent.\n\
                  # TYPE kt_bytes_sent counter\n\
                  # UNIT kt_bytes_sent bytes\n\
                  kt_bytes_sent_total 3\n\
                  # HELP kt_build The version.\n\
                  # TYPE kt_build info\n\
                  kt_build_info{version=\"1.0\"} 1\n\
                  # HELP kt_up Up.\n\
                  # TYPE kt_up gauge\n\
                  kt_up 1\n\
                  # EOF\n";
        let text = to_prometheus_text(om);
        assert_eq!(
            text,
            "# HELP kt_bytes_sent_total File content bytes sent.\n\
             # TYPE kt_bytes_sent_total counter\n\
             kt_bytes_sent_total 3\n\
             # HELP kt_build_info The version.\n\
             # TYPE kt_build_info gauge\n\
             kt_build_info{version=\"1.0\"} 1\n\
             # HELP kt_up Up.\n\
             # TYPE kt_up gauge\n\
             kt_up 1\n"
        );
    }
}
