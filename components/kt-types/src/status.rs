//! `GET /api/v1/status`: what the metadata server holds and does, summed
//! (`kt status` shows it; the metadata server's scrape-time gauges are the
//! same figures).
//!
//! Every list is keyed by bounded values (services, locales, states, group
//! ids of broadcasts in flight), never by key.

use serde::{Deserialize, Serialize};

/// The summary of one metadata server.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The metadata server's version.
    pub version: String,
    /// Where the store registered itself, if it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_url: Option<String>,
    /// Keys and their bytes by service and locale (live records only).
    pub usage: Vec<ServiceUsage>,
    /// Agents by the service they announced (`""` for none).
    pub agents: Vec<AgentCount>,
    /// Read leases in flight (getters reading now) by the kind of source.
    pub leases: Vec<LeaseCount>,
    /// Broadcast groups held, with their members by state.
    pub broadcasts: Vec<BroadcastSummary>,
    /// GPU quorums by state.
    pub quorums: QuorumSummary,
}

/// Keys of one service in one locale.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceUsage {
    /// The owning service ([`crate::KeyRecord::service`]).
    pub service: String,
    /// `store` or `local`.
    pub locale: String,
    /// Live keys.
    pub keys: u64,
    /// Their bytes (the current versions' sizes).
    pub bytes: u64,
}

/// Agents of one service.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentCount {
    /// The service the agents announced (`""` for none).
    pub service: String,
    /// Heard from within the agent TTL.
    pub live: u64,
    /// Known but silent for longer (not sources until they beat again).
    pub stale: u64,
}

/// Leases on one kind of source.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseCount {
    /// `store` or `agent`.
    pub source: String,
    /// Unexpired leases.
    pub leases: u64,
}

/// One broadcast group.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BroadcastSummary {
    /// The group's id.
    pub group: String,
    /// The key it broadcasts.
    pub key: String,
    /// Still open to joins.
    pub open: bool,
    /// Members downloading.
    pub active: u64,
    /// Members whose copy is complete.
    pub done: u64,
    /// Members that left before finishing.
    pub gone: u64,
}

/// GPU quorums by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuorumSummary {
    /// Rounds open to members.
    pub open: u64,
    /// Closed rounds whose transfer runs.
    pub transferring: u64,
    /// Kept transfers every rank reported done.
    pub complete: u64,
    /// Kept transfers a rank reported failed.
    pub failed: u64,
}

/// The samples of a Prometheus text exposition (what `kt status` reads
/// from the store's `/metrics`): `name{labels} value` lines, comments
/// skipped.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Samples(Vec<Sample>);

/// One sample: its name, labels and value.
type Sample = (String, Vec<(String, String)>, f64);

impl Samples {
    /// Parses `text`; lines that are not samples are skipped.
    pub fn parse(text: &str) -> Samples {
        let sample = |l: &str| {
            let (series, value) = l.rsplit_once(' ')?;
            let value = value.parse::<f64>().ok()?;
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, labels(rest.strip_suffix('}')?)?),
                None => (series, Vec::new()),
            };
            Some((name.to_owned(), labels, value))
        };
        Samples(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(sample)
                .collect(),
        )
    }

    /// The sum of `name`'s samples (all label sets); 0 when there is none.
    pub fn sum(&self, name: &str) -> f64 {
        self.0
            .iter()
            .filter(|(n, _, _)| n == name)
            .map(|(_, _, v)| v)
            .sum()
    }

    /// The value of `name`'s first sample that has every label of `labels`.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.0.iter().find_map(|(n, l, v)| {
            let all = labels
                .iter()
                .all(|(k, want)| l.iter().any(|(lk, lv)| lk == k && lv == want));
            (n == name && all).then_some(*v)
        })
    }

    /// Whether `name` has a sample at all.
    pub fn has(&self, name: &str) -> bool {
        self.0.iter().any(|(n, _, _)| n == name)
    }

    /// The value of `label` on `name`'s first sample.
    pub fn label(&self, name: &str, label: &str) -> Option<&str> {
        let (_, labels, _) = self.0.iter().find(|(n, _, _)| n == name)?;
        labels
            .iter()
            .find(|(k, _)| k == label)
            .map(|(_, v)| v.as_str())
    }
}

/// `a="x",b="y"` (values escaped as the text format does).
fn labels(s: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut rest = s.trim_start_matches(',');
    while !rest.is_empty() {
        let (name, after) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        out.push((name.trim().to_owned(), value));
        rest = after[end + 1..].trim_start_matches(',');
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_summed_and_labels_read() {
        let text = "# HELP kt_build_info v\n\
                    kt_build_info{version=\"0.1.0\"} 1\n\
                    kt_bytes_sent_total 10\n\
                    kt_x{a=\"q\\\"uote,d\",b=\"2\"} 3\n\
                    kt_x{a=\"z\"} 4.5\n";
        let s = Samples::parse(text);
        assert_eq!(s.label("kt_build_info", "version"), Some("0.1.0"));
        assert_eq!(s.sum("kt_bytes_sent_total"), 10.0);
        assert_eq!(s.sum("kt_x"), 7.5);
        assert_eq!(s.label("kt_x", "a"), Some("q\"uote,d"));
        assert_eq!(s.label("kt_x", "b"), Some("2"));
        assert_eq!(s.get("kt_x", &[("a", "z")]), Some(4.5));
        assert_eq!(s.get("kt_x", &[("b", "2")]), Some(3.0));
        assert_eq!(s.get("kt_x", &[("b", "3")]), None);
        assert!(!s.has("kt_missing"));
        assert_eq!(s.sum("kt_missing"), 0.0);
    }
}
