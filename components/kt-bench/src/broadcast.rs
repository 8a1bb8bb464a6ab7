//! The broadcast benchmark's driver (`kt-bench-broadcast`, `make
//! bench-broadcast`): runs the scenarios of `testbed/bench/` with
//! kt-scenario on the netns target and turns what each reports into a table
//! and one line.
//!
//! Each scenario moves one payload to 32 pods in legs named after
//! [`STEPS`]: a single point-to-point get (`single`), 32 gets from the store
//! at once (`star`), a broadcast in kt's default shape (`tree`) and, in the
//! link-bound scenario, a broadcast whose rank 1 is SIGKILLed midway
//! (`killed`: its 31 survivors). Around the legs a `metrics` step records the
//! store's `kt_bytes_sent_total` (`store-sent-0`, `store-sent-1`, … in leg
//! order). From
//! the run the driver reads:
//! - `report.json`: each step's status, its operation time (`op_ms`: first pod
//!   command's start to the last one's exit; verification not included) and
//!   per-pod durations;
//! - the scenario's snapshot (written into the report directory, accepted
//!   fresh each run): the steps' records — transfer totals, the tree's shape,
//!   the store counter's readings and, for broadcast legs with `timings:
//!   true`, where each member's time went (`members`, by rank: the phases of
//!   [`MemberTimings`]), which [`member_table`] shows.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use kt_types::api::MemberTimings;
use kt_types::size::human;
use serde::Deserialize;
use serde_json::Value;

/// The legs a scenario may name (the order of the final line).
pub const STEPS: [&str; 4] = ["single", "star", "tree", "killed"];
/// The targets: a broadcast's last pod about as fast as one transfer, far
/// faster than the store serving everyone, and still within half a transfer
/// more with an interior member killed midway.
pub const TREE_OVER_SINGLE_MAX: f64 = 1.2;
pub const STAR_OVER_TREE_MIN: f64 = 8.0;
pub const KILLED_OVER_SINGLE_MAX: f64 = 1.5;

/// Where the run's files are.
#[derive(Debug, Clone)]
pub struct RunFiles {
    pub report_dir: PathBuf,
    /// Where kt-scenario keeps (and, with `--accept`, writes) snapshots.
    pub snapshot_dir: PathBuf,
}

impl RunFiles {
    pub fn new(report_dir: &Path) -> RunFiles {
        RunFiles {
            report_dir: report_dir.to_owned(),
            snapshot_dir: report_dir.join("snapshots"),
        }
    }

    /// Removes what an earlier run left, so nothing stale is read.
    pub fn clear(&self) -> std::io::Result<()> {
        for f in ["report.json", "junit.xml", "report.html"] {
            match std::fs::remove_file(self.report_dir.join(f)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        match std::fs::remove_dir_all(&self.snapshot_dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// The `kt-scenario run` arguments of the benchmark: snapshots go to the
/// report directory and are accepted (they hold the run's measurements, not
/// expectations).
pub fn scenario_args(
    scenario: &Path,
    target: &str,
    files: &RunFiles,
    bin_dir: &Path,
    extra: &[String],
) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "run".into(),
        scenario.display().to_string(),
        "--target".into(),
        target.into(),
        "--report".into(),
        files.report_dir.display().to_string(),
        "--snapshots".into(),
        files.snapshot_dir.display().to_string(),
        "--accept".into(),
        "--bin-dir".into(),
        bin_dir.display().to_string(),
    ];
    a.extend(extra.iter().cloned());
    a
}

/// The parts of kt-scenario's `report.json` the driver reads.
#[derive(Debug, Clone, Deserialize)]
pub struct RunReport {
    pub target: String,
    pub duration_ms: f64,
    pub scenarios: Vec<ScenarioReport>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ScenarioReport {
    pub name: String,
    pub status: String,
    #[serde(default)]
    pub message: Option<String>,
    pub setup_ms: f64,
    pub duration_ms: f64,
    pub steps: Vec<StepReport>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct StepReport {
    pub name: String,
    pub status: String,
    #[serde(default)]
    pub error: Option<String>,
    pub duration_ms: f64,
    pub op_ms: f64,
    #[serde(default)]
    pub pods: Vec<PodReport>,
    /// How busy the host's cores were during the step (0 to 1).
    #[serde(default)]
    pub cpu_busy: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct PodReport {
    pub pod: String,
    pub ok: bool,
    pub duration_ms: f64,
    pub finished_at_ms: f64,
}

/// One measured way of moving the payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Leg {
    pub name: &'static str,
    pub pods: usize,
    /// Seconds from the first get's start to the last one's exit.
    pub secs: f64,
    /// Per-pod command durations, seconds, sorted.
    pub pod_secs: Vec<f64>,
    /// What the store served meanwhile (its counter's difference), bytes.
    pub store_egress: Option<u64>,
    /// How busy the host's cores were (0 to 1) during the leg.
    pub cpu_busy: Option<f64>,
    /// A broadcast leg's members, by rank, where the step recorded them.
    pub members: Vec<Member>,
}

/// A broadcast member as its leg's record has it (`members`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Member {
    pub rank: u32,
    /// The ranks it fetched from, in order.
    #[serde(default)]
    pub parents: Vec<u32>,
    /// Bytes it served to its children.
    #[serde(default)]
    pub relayed: u64,
    /// Its whole get, seconds (where the snapshot did not redact it).
    #[serde(default, deserialize_with = "a_number")]
    pub seconds: Option<f64>,
    /// Where the time went (absent from a kt that does not report it).
    #[serde(flatten)]
    pub timings: Option<MemberTimings>,
}

/// A number, or `None` for anything else (a snapshot redacts times as
/// `"[time]"`).
fn a_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    Ok(Value::deserialize(d)?.as_f64())
}

impl Member {
    /// Its whole get, ms: the sum of its phases (which add up to it), else
    /// its recorded seconds.
    pub fn total_ms(&self) -> Option<f64> {
        match &self.timings {
            Some(t) => {
                Some((t.join_ms + t.first_byte_ms + t.receive_ms + t.finish_ms + t.serve_ms) as f64)
            }
            None => self.seconds.map(|s| (s * 1e3).round()),
        }
    }
}

/// The members a leg's record lists (those that cannot be read are left out).
fn members(record: &Value) -> Vec<Member> {
    let mut out: Vec<Member> = record["members"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| serde_json::from_value(m.clone()).ok())
        .collect();
    out.sort_by_key(|m| m.rank);
    out
}

/// From this share of busy cores on, a leg's time is the cores' limit.
pub const CPU_BOUND: f64 = 0.9;

/// Everything the summary needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Results {
    /// The payload's size, bytes.
    pub size: u64,
    pub legs: Vec<Leg>,
    /// The tree's fanout, members with the store as parent, and members that
    /// had a parent replaced.
    pub fanout: Option<u64>,
    pub store_children: Option<u64>,
    pub replaced: Option<u64>,
    /// Depth of the deepest member (rank 0 at depth 0).
    pub depth: Option<u64>,
}

impl Results {
    pub fn leg(&self, name: &str) -> Option<&Leg> {
        self.legs.iter().find(|l| l.name == name)
    }

    /// The store's egress during the tree step: its counter when read, else
    /// what the tree's shape implies (a full copy to each child of rank 0).
    pub fn store_egress_tree(&self) -> Option<u64> {
        self.leg("tree")?
            .store_egress
            .or_else(|| Some(self.store_children? * self.size))
    }
}

/// Reads `report.json`.
pub fn read_report(files: &RunFiles) -> anyhow::Result<RunReport> {
    let path = files.report_dir.join("report.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The body of an insta snapshot file (after its `---` header) as JSON.
pub fn parse_snapshot(text: &str) -> anyhow::Result<Value> {
    let body = text
        .strip_prefix("---\n")
        .and_then(|rest| rest.split_once("\n---\n"))
        .map(|(_, body)| body)
        .context("not an insta snapshot (no `---` header)")?;
    serde_yaml_ng::from_str(body).context("the snapshot's body is not YAML")
}

/// The records of scenario `name`'s snapshot.
pub fn read_records(files: &RunFiles, name: &str) -> anyhow::Result<Value> {
    let path = files.snapshot_dir.join(format!("{name}.snap"));
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let v = parse_snapshot(&text).with_context(|| path.display().to_string())?;
    Ok(v.get("recorded").cloned().unwrap_or(Value::Null))
}

/// The store's counter in a `metrics` step's record (`count`, `min`,
/// `median`, `max`, `largest`: the spread over the component's instances).
/// The bench's topology has one store; with several, the record does not
/// hold their total, so there is no reading.
fn counter(record: &Value) -> Option<u64> {
    if record.get("count")?.as_u64()? != 1 {
        return None;
    }
    let v = record.get("max")?.as_f64()?;
    (v.is_finite() && v >= 0.0).then_some(v as u64)
}

/// Depth of rank `r` in a tree given as `rank -> parent`.
fn depth_of(parents: &std::collections::BTreeMap<u64, u64>, mut r: u64) -> u64 {
    let mut d = 0;
    while r != 0 && d <= parents.len() as u64 {
        r = parents.get(&r).copied().unwrap_or(0);
        d += 1;
    }
    d
}

/// Puts the scenario's report and records together.
pub fn results(scenario: &ScenarioReport, records: &Value) -> anyhow::Result<Results> {
    let single = &records["single"];
    let size =
        single["bytes_sent"].as_u64().unwrap_or(0) + single["bytes_skipped"].as_u64().unwrap_or(0);
    if size == 0 {
        bail!("the single get's record holds no size: {single}");
    }
    let reading = |i: usize| records.get(format!("store-sent-{i}")).and_then(counter);
    let mut legs = Vec::new();
    // Legs in the scenario's order: the k-th lies between readings k and k + 1.
    let ran = scenario
        .steps
        .iter()
        .filter_map(|s| Some((*STEPS.iter().find(|n| **n == s.name)?, s)));
    for (i, (name, step)) in ran.enumerate() {
        if step.status != "passed" {
            continue;
        }
        let mut pod_secs: Vec<f64> = step.pods.iter().map(|p| p.duration_ms / 1e3).collect();
        pod_secs.sort_by(f64::total_cmp);
        let store_egress = match (reading(i), reading(i + 1)) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        };
        legs.push(Leg {
            name,
            pods: step.pods.len(),
            secs: step.op_ms / 1e3,
            pod_secs,
            store_egress,
            cpu_busy: step.cpu_busy,
            members: members(&records[name]),
        });
    }
    let bc = &records["tree"]["broadcast"];
    // Small trees are recorded rank by rank (`rank <- parent state`), large
    // ones as children per parent.
    let mut parents = std::collections::BTreeMap::new();
    for line in bc["tree"].as_array().into_iter().flatten() {
        let mut it = line.as_str().unwrap_or("").split_whitespace();
        if let (Some(r), Some("<-"), Some(p)) = (it.next(), it.next(), it.next())
            && let (Ok(r), Ok(p)) = (r.parse::<u64>(), p.parse::<u64>())
        {
            parents.insert(r, p);
        }
    }
    let fanout = bc["fanout"].as_u64();
    let members = bc["members"].as_u64();
    if parents.is_empty()
        && let (Some(n), Some(f)) = (members, fanout)
    {
        // The layout the group starts with: rank r under (r - 1) / fanout.
        parents = (1..=n).map(|r| (r, (r - 1) / f.max(1))).collect();
    }
    let store_children = match bc["children_per_parent"].get("0") {
        Some(c) => c.as_u64(),
        None => (!parents.is_empty()).then(|| parents.values().filter(|p| **p == 0).count() as u64),
    };
    let depth = (!parents.is_empty()).then(|| {
        parents
            .keys()
            .map(|r| depth_of(&parents, *r))
            .max()
            .unwrap_or(0)
    });
    Ok(Results {
        size,
        legs,
        fanout,
        store_children,
        replaced: bc["replaced"].as_u64(),
        depth,
    })
}

/// `4.35s`, `139.2s`.
pub fn secs(s: f64) -> String {
    if s < 100.0 {
        format!("{s:.2}s")
    } else {
        format!("{s:.1}s")
    }
}

/// `1.17`, `27.3`.
pub fn ratio(r: f64) -> String {
    if r < 10.0 {
        format!("{r:.2}")
    } else {
        format!("{r:.1}")
    }
}

/// Nearest-rank percentile of sorted `v` ([`kt_types::stats::percentile`]);
/// NaN for a leg without pods.
fn pct(v: &[f64], p: f64) -> f64 {
    kt_types::stats::percentile(v, p).unwrap_or(f64::NAN)
}

/// The results table: per way, pods, time, per-pod spread, delivered rate
/// and the store's egress.
pub fn table(r: &Results) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<7} {:>4} {:>9} {:>9} {:>9} {:>9} {:>12} {:>13} {:>11} {:>5}",
        "way",
        "pods",
        "time",
        "pod min",
        "pod p50",
        "pod max",
        "delivered",
        "store egress",
        "store link",
        "cpu"
    );
    for l in &r.legs {
        let delivered = l.pods as u64 * r.size;
        let gbit = |b: u64| b as f64 * 8.0 / l.secs / 1e9;
        let _ = writeln!(
            out,
            "{:<7} {:>4} {:>9} {:>9} {:>9} {:>9} {:>7.2}Gbit/s {:>13} {:>11} {:>5}",
            l.name,
            l.pods,
            secs(l.secs),
            secs(pct(&l.pod_secs, 0.0)),
            secs(pct(&l.pod_secs, 50.0)),
            secs(pct(&l.pod_secs, 100.0)),
            gbit(delivered),
            l.store_egress.map(human).unwrap_or_else(|| "?".into()),
            l.store_egress
                .map(|b| format!("{:.2}Gbit/s", gbit(b)))
                .unwrap_or_else(|| "?".into()),
            l.cpu_busy
                .map(|c| format!("{:.0}%", c * 100.0))
                .unwrap_or_else(|| "?".into()),
        );
    }
    let _ = write!(out, "payload {}", human(r.size));
    if let Some(f) = r.fanout {
        let _ = write!(out, "; tree: fanout {f}");
    }
    if let Some(d) = r.depth {
        let _ = write!(out, ", depth {d}");
    }
    if let Some(c) = r.store_children {
        let _ = write!(out, ", {c} member(s) fed by the store");
    }
    if let Some(n) = r.replaced.filter(|n| *n > 0) {
        let _ = write!(out, ", {n} parent replacement(s)");
    }
    out.push('\n');
    out
}

/// Per broadcast leg that recorded its members: where each member's time
/// went, one row per rank (milliseconds; `hash` and `write` are summed over
/// parallel streams, `waited` is within `receive`), then the medians.
pub fn member_table(r: &Results) -> String {
    let mut out = String::new();
    for l in r.legs.iter().filter(|l| !l.members.is_empty()) {
        let _ = writeln!(
            out,
            "{}: where each member's time went (ms; join + first byte + receive + finish + \
             serve = its get; waited: pauses within receive; hash, write: summed over streams)",
            l.name
        );
        let _ = writeln!(
            out,
            "{:>4} {:>9} {:>8} {:>6} {:>6} {:>8} {:>7} {:>6} {:>6} {:>7} {:>7} {:>6} {:>10}",
            "rank",
            "from",
            "total",
            "join",
            "first",
            "receive",
            "waited",
            "hash",
            "write",
            "finish",
            "serve",
            "cpu",
            "relayed"
        );
        let mut cols: Vec<Vec<f64>> = vec![Vec::new(); 10];
        for m in &l.members {
            let from = m
                .parents
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(">");
            let total = m.total_ms().unwrap_or(f64::NAN);
            let Some(t) = &m.timings else {
                let _ = writeln!(
                    out,
                    "{:>4} {from:>9} {:>8} {:>6} (no timings reported) {:>10}",
                    m.rank,
                    if total.is_nan() {
                        "-".to_owned()
                    } else {
                        format!("{total:.0}")
                    },
                    "",
                    human(m.relayed)
                );
                continue;
            };
            let row = [
                total,
                t.join_ms as f64,
                t.first_byte_ms as f64,
                t.receive_ms as f64,
                t.waited_ms as f64,
                t.hash_ms as f64,
                t.write_ms as f64,
                t.finish_ms as f64,
                t.serve_ms as f64,
                t.cpu_ms.map_or(f64::NAN, |c| c as f64),
            ];
            for (c, v) in cols.iter_mut().zip(row) {
                if !v.is_nan() {
                    c.push(v);
                }
            }
            let _ = writeln!(
                out,
                "{:>4} {from:>9} {}{:>10}",
                m.rank,
                cells(&row),
                human(m.relayed)
            );
        }
        if cols[0].len() > 1 {
            let medians: Vec<f64> = cols
                .iter_mut()
                .map(|c| {
                    c.sort_by(f64::total_cmp);
                    pct(c, 50.0)
                })
                .collect();
            let _ = writeln!(out, "{:>4} {:>9} {}", "p50", "", cells(&medians));
        }
    }
    out
}

/// The ten time columns of [`member_table`] (`-` where unknown).
fn cells(v: &[f64]) -> String {
    let widths = [8, 6, 6, 8, 7, 6, 6, 7, 7, 6];
    let mut s = String::new();
    for (x, w) in v.iter().zip(widths) {
        let cell = if x.is_nan() {
            "-".to_owned()
        } else {
            format!("{x:.0}")
        };
        let _ = write!(s, "{cell:>w$} ");
    }
    s
}

/// `broadcast NAME: single=… star=… tree=… killed=… tree/single=… star/tree=…
/// killed/single=… store_egress_tree=…` (bytes; a missing way leaves its
/// fields out).
pub fn final_line(name: &str, r: &Results) -> String {
    let mut line = format!("broadcast {name}:");
    let t = |n: &str| r.leg(n).map(|l| l.secs);
    for n in STEPS {
        if let Some(s) = t(n) {
            let _ = write!(line, " {n}={}", secs(s));
        }
    }
    for (a, b, v, _) in ratios(r) {
        let _ = write!(line, " {a}/{b}={}", ratio(v));
    }
    if let Some(b) = r.store_egress_tree() {
        let _ = write!(line, " store_egress_tree={b}");
    }
    line
}

/// A ratio of two legs' times and its target.
#[derive(Debug, Clone, Copy)]
enum Target {
    AtMost(f64),
    AtLeast(f64),
}

/// The ratios the final line prints, in order, with their targets.
const RATIOS: [(&str, &str, Target); 3] = [
    ("tree", "single", Target::AtMost(TREE_OVER_SINGLE_MAX)),
    ("star", "tree", Target::AtLeast(STAR_OVER_TREE_MIN)),
    ("killed", "single", Target::AtMost(KILLED_OVER_SINGLE_MAX)),
];

/// Each of [`RATIOS`] both of whose legs ran: its legs, value and target.
fn ratios(r: &Results) -> impl Iterator<Item = (&'static str, &'static str, f64, Target)> + '_ {
    RATIOS.into_iter().filter_map(|(a, b, target)| {
        let (x, y) = (r.leg(a)?.secs, r.leg(b)?.secs);
        Some((a, b, x / y, target))
    })
}

/// Whether the targets are met (informational).
pub fn targets(r: &Results) -> Vec<String> {
    let mut out = Vec::new();
    for (a, b, v, target) in ratios(r) {
        let (op, bound, ok) = match target {
            Target::AtMost(m) => ("<=", m, v <= m),
            Target::AtLeast(m) => (">=", m, v >= m),
        };
        out.push(format!("{a}/{b} {} {op} {bound}: {}", ratio(v), met(ok)));
        if a == "tree"
            && b == "single"
            && let Some(f) = r.fanout.filter(|f| *f > 1)
        {
            out.push(format!(
                "  (with equal links a relay's egress carries each byte to {f} children: \
                 tree/single >= about {f}; a chain (fanout 1) sends each byte once per link)"
            ));
        }
    }
    let bound: Vec<String> = (r.legs.iter())
        .filter_map(|l| {
            let c = l.cpu_busy.filter(|c| *c >= CPU_BOUND)?;
            Some(format!("{} {:.0}%", l.name, c * 100.0))
        })
        .collect();
    if !bound.is_empty() {
        out.push(format!(
            "CPU-bound legs (cores busy: {}): their times are this host's limit, \
             not the links'",
            bound.join(", ")
        ));
    }
    out
}

fn met(yes: bool) -> &'static str {
    if yes { "met" } else { "NOT met" }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const SNAP: &str = "---\nsource: components/kt-scenario/src/snapshot.rs\ndescription: \"x\"\n---\nrecorded:\n  single:\n    bytes_sent: 536870912\n    bytes_skipped: 0\n    files: 1\n  star:\n    bytes_sent_total: 17179869184\n    pods: 32\n  store-sent-0:\n    count: 1\n    largest: store\n    max: 0\n    median: 0\n    min: 0\n  store-sent-1:\n    count: 1\n    largest: store\n    max: 536870912\n    median: 536870912\n    min: 536870912\n  store-sent-2:\n    count: 1\n    largest: store\n    max: 17716740096.0\n    median: 17716740096.0\n    min: 17716740096.0\n  store-sent-3:\n    count: 1\n    largest: store\n    max: 18790481920\n    median: 18790481920\n    min: 18790481920\n  tree:\n    broadcast:\n      fanout: 2\n      replaced: 0\n      tree:\n        - 1 <- 0 done\n        - 2 <- 0 done\n        - 3 <- 1 done\n        - 4 <- 1 done\n        - 5 <- 2 done\n        - 6 <- 3 done\nscenario: broadcast\n";

    fn step(name: &str, op_ms: f64, pods: usize) -> StepReport {
        StepReport {
            name: name.into(),
            status: "passed".into(),
            error: None,
            duration_ms: op_ms + 1000.0,
            op_ms,
            cpu_busy: Some(0.5),
            pods: (0..pods)
                .map(|i| PodReport {
                    pod: format!("{name}-{i}"),
                    ok: true,
                    duration_ms: op_ms - i as f64,
                    finished_at_ms: op_ms,
                })
                .collect(),
        }
    }

    fn scenario() -> ScenarioReport {
        ScenarioReport {
            name: "broadcast".into(),
            status: "passed".into(),
            message: None,
            setup_ms: 1.0,
            duration_ms: 2.0,
            steps: vec![
                step("single", 4350.0, 1),
                step("star", 139_200.0, 32),
                step("tree", 5100.0, 6),
            ],
        }
    }

    #[test]
    fn the_snapshot_body_is_read_past_its_header() {
        let v = parse_snapshot(SNAP).unwrap();
        assert_eq!(v["scenario"], json!("broadcast"));
        assert_eq!(v["recorded"]["single"]["bytes_sent"], json!(536870912u64));
        assert!(parse_snapshot("a: 1\n").is_err());
    }

    /// A `metrics` step's record: the store's counter is its `max`, written
    /// as an integer or a float; no reading where it spans several stores
    /// or is not a count of bytes.
    #[test]
    fn the_store_counter_is_read_from_a_metrics_record() {
        let recs = parse_snapshot(SNAP).unwrap()["recorded"].clone();
        assert_eq!(counter(&recs["store-sent-1"]), Some(512 << 20));
        assert_eq!(counter(&recs["store-sent-2"]), Some(17_716_740_096));
        let spread = |count: u64, max: Value| json!({ "count": count, "min": 0, "median": 0, "max": max, "largest": "store" });
        assert_eq!(counter(&spread(1, json!(0))), Some(0));
        assert_eq!(counter(&spread(2, json!(1024))), None);
        assert_eq!(counter(&spread(0, json!(0))), None);
        assert_eq!(counter(&spread(1, json!(-1.0))), None);
        assert_eq!(counter(&spread(1, json!("[redacted]"))), None);
        assert_eq!(counter(&json!({ "max": 1024 })), None);
    }

    #[test]
    fn results_and_the_final_line() {
        let recs = parse_snapshot(SNAP).unwrap()["recorded"].clone();
        let r = results(&scenario(), &recs).unwrap();
        assert_eq!(r.size, 512 << 20);
        assert_eq!(r.legs.len(), 3);
        assert_eq!(r.leg("single").unwrap().store_egress, Some(512 << 20));
        assert_eq!(r.leg("star").unwrap().store_egress, Some(16 << 30));
        assert_eq!(r.store_egress_tree(), Some(1 << 30));
        assert_eq!(
            (r.fanout, r.store_children, r.depth),
            (Some(2), Some(2), Some(3))
        );
        assert_eq!(
            final_line("b", &r),
            "broadcast b: single=4.35s star=139.2s tree=5.10s tree/single=1.17 star/tree=27.3 \
             store_egress_tree=1073741824"
        );
        let t = targets(&r);
        assert!(t[0].starts_with("tree/single 1.17 <= 1.2: met"), "{t:?}");
        assert!(
            t.last().unwrap().contains("star/tree 27.3 >= 8: met"),
            "{t:?}"
        );
        let table = table(&r);
        assert!(table.lines().count() == 5, "{table}");
        assert!(table.contains("16.00 GiB"), "{table}");
    }

    #[test]
    fn without_the_counter_the_tree_shape_gives_the_store_egress() {
        let mut recs = parse_snapshot(SNAP).unwrap()["recorded"].clone();
        recs.as_object_mut().unwrap().remove("store-sent-3");
        let r = results(&scenario(), &recs).unwrap();
        assert_eq!(r.leg("tree").unwrap().store_egress, None);
        assert_eq!(r.store_egress_tree(), Some(2 * (512 << 20)));
        // A failed step is left out of the line.
        let mut s = scenario();
        s.steps[2].status = "failed".into();
        let r = results(&s, &recs).unwrap();
        assert_eq!(final_line("b", &r), "broadcast b: single=4.35s star=139.2s");
    }

    /// Legs are read in the scenario's order, whatever it is: the readings
    /// around the k-th are `store-sent-k` and `store-sent-k+1`.
    #[test]
    fn a_killed_leg_first_shifts_the_readings() {
        let mut recs = parse_snapshot(SNAP).unwrap()["recorded"].clone();
        let reading = |v: u64| {
            let v = v as f64;
            json!({ "count": 1, "min": v, "median": v, "max": v, "largest": "store" })
        };
        let m = 512u64 << 20;
        for (i, v) in [
            0,
            m + (64 << 20),
            2 * m + (64 << 20),
            34 * m + (64 << 20),
            35 * m + (64 << 20),
        ]
        .into_iter()
        .enumerate()
        {
            recs[format!("store-sent-{i}")] = reading(v);
        }
        let mut s = scenario();
        s.steps.insert(0, step("killed", 6000.0, 31));
        s.steps[0].cpu_busy = Some(0.97);
        let r = results(&s, &recs).unwrap();
        assert_eq!(r.leg("killed").unwrap().store_egress, Some(m + (64 << 20)));
        assert_eq!(r.leg("single").unwrap().store_egress, Some(m));
        assert_eq!(r.leg("tree").unwrap().store_egress, Some(m));
        assert!(
            final_line("b", &r).ends_with("killed/single=1.38 store_egress_tree=536870912"),
            "{}",
            final_line("b", &r)
        );
        let t = targets(&r);
        assert!(
            t.iter()
                .any(|l| l.starts_with("killed/single 1.38 <= 1.5: met")),
            "{t:?}"
        );
        assert!(
            t.last()
                .unwrap()
                .starts_with("CPU-bound legs (cores busy: killed 97%)"),
            "{t:?}"
        );
        assert!(table(&r).contains("97%"));
    }

    #[test]
    fn large_trees_are_read_from_children_per_parent() {
        let mut recs = parse_snapshot(SNAP).unwrap()["recorded"].clone();
        recs["tree"]["broadcast"] = json!({
            "fanout": 2, "members": 32, "replaced": 0,
            "children_per_parent": { "0": 2, "1": 2, "15": 1 },
            "states": { "done": 32 },
        });
        let r = results(&scenario(), &recs).unwrap();
        assert_eq!(
            (r.fanout, r.store_children, r.depth),
            (Some(2), Some(2), Some(5))
        );
    }

    /// A leg that recorded its members shows where each one's time went,
    /// and the medians; one from a kt without timings still gets its row.
    #[test]
    fn each_member_s_time_is_tabled() {
        let mut recs = parse_snapshot(SNAP).unwrap()["recorded"].clone();
        let member = |rank: u32, parent: u32, first: u64, waited: u64| {
            json!({
                "rank": rank, "parents": [parent], "relayed": if rank < 3 { 536870912u64 } else { 0 },
                "seconds": if rank == 2 { json!("[time]") } else { json!(5.0) }, "join_ms": 10, "first_byte_ms": first, "receive_ms": 4700,
                "waited_ms": waited, "hash_ms": 900, "write_ms": 400, "finish_ms": 40,
                "serve_ms": 250 - first, "cpu_ms": 2100,
            })
        };
        recs["tree"]["members"] = json!([
            member(2, 0, 30, 0),
            member(1, 0, 20, 0),
            member(3, 1, 60, 1200),
            { "rank": 4, "parents": [1, 2], "relayed": 0, "seconds": 6.5 },
        ]);
        let r = results(&scenario(), &recs).unwrap();
        let tree = r.leg("tree").unwrap();
        assert_eq!(
            tree.members.iter().map(|m| m.rank).collect::<Vec<_>>(),
            [1, 2, 3, 4]
        );
        let t = tree.members[2].timings.as_ref().unwrap();
        assert_eq!(
            (t.first_byte_ms, t.waited_ms, t.cpu_ms),
            (60, 1200, Some(2100))
        );
        assert!(tree.members[3].timings.is_none());
        assert!(r.leg("single").unwrap().members.is_empty());

        let text = member_table(&r);
        let lines: Vec<&str> = text.lines().collect();
        // A title, the header, four members, the medians.
        assert_eq!(lines.len(), 7, "{text}");
        assert!(lines[0].starts_with("tree: where each member's time went"));
        let cols = |l: &str| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
        assert_eq!(
            cols(lines[4]),
            [
                "3", "1", "5000", "10", "60", "4700", "1200", "900", "400", "40", "190", "2100",
                "0", "B"
            ]
        );
        assert!(
            lines[5].contains("1>2") && lines[5].contains("no timings"),
            "{text}"
        );
        assert_eq!(cols(lines[6])[..5], ["p50", "5000", "10", "30", "4700"]);
        // Without members, no table.
        let recs = parse_snapshot(SNAP).unwrap()["recorded"].clone();
        assert_eq!(member_table(&results(&scenario(), &recs).unwrap()), "");
    }

    #[test]
    fn formats() {
        assert_eq!(secs(4.349), "4.35s");
        assert_eq!(secs(139.24), "139.2s");
        assert_eq!(ratio(1.172), "1.17");
        assert_eq!(ratio(27.29), "27.3");
    }

    #[test]
    fn the_run_is_driven_with_fresh_accepted_snapshots() {
        let f = RunFiles::new(Path::new("target/bench-broadcast"));
        let a = scenario_args(
            Path::new("testbed/bench/broadcast.yaml"),
            "netns",
            &f,
            Path::new("target/release"),
            &["--keep".into()],
        );
        assert_eq!(
            a.join(" "),
            "run testbed/bench/broadcast.yaml --target netns --report target/bench-broadcast \
             --snapshots target/bench-broadcast/snapshots --accept --bin-dir target/release --keep"
        );
    }
}
