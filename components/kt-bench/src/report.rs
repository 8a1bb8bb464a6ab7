//! Medians, the results table and the one-line ratio summary.

use std::fmt::Write;

/// The timings of one case, in seconds, one per run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CaseResult {
    pub name: &'static str,
    /// What the case moves, for the table.
    pub what: String,
    /// Bytes of content a run moves (0: none, as in a no-op).
    pub bytes: u64,
    pub kt: Vec<f64>,
    pub rsync: Vec<f64>,
    /// CPU seconds of each run (kt: this process; rsync: its client and daemon).
    pub kt_cpu: Vec<f64>,
    pub rsync_cpu: Vec<f64>,
}

impl CaseResult {
    pub fn kt_median(&self) -> f64 {
        median(&self.kt)
    }

    pub fn rsync_median(&self) -> f64 {
        median(&self.rsync)
    }

    /// kt time over rsync time (lower is better for kt).
    pub fn ratio(&self) -> f64 {
        self.kt_median() / self.rsync_median()
    }

    /// Median CPU seconds per GiB moved: (kt, rsync); NaN without bytes.
    pub fn cpu_per_gib(&self) -> (f64, f64) {
        (
            crate::cpu::secs_per_gib(median(&self.kt_cpu), self.bytes),
            crate::cpu::secs_per_gib(median(&self.rsync_cpu), self.bytes),
        )
    }
}

/// The median (the mean of the middle two for an even count; NaN when empty).
pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn runs(xs: &[f64]) -> String {
    xs.iter()
        .map(|x| format!("{x:.3}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The results table: medians, ratio, CPU medians, and every run.
pub fn table(results: &[CaseResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<14} {:>10} {:>10} {:>9} {:>10} {:>10}  {:<24} {:<24} what",
        "case",
        "kt (s)",
        "rsync (s)",
        "kt/rsync",
        "kt cpu(s)",
        "rs cpu(s)",
        "kt runs (s)",
        "rsync runs (s)"
    );
    for r in results {
        let _ = writeln!(
            out,
            "{:<14} {:>10.3} {:>10.3} {:>9.2} {:>10.3} {:>10.3}  {:<24} {:<24} {}",
            r.name,
            r.kt_median(),
            r.rsync_median(),
            r.ratio(),
            median(&r.kt_cpu),
            median(&r.rsync_cpu),
            runs(&r.kt),
            runs(&r.rsync),
            r.what
        );
    }
    out
}

/// `cpu-s/GiB large_cold=kt:K,rsync:R ...` for the cases that move at
/// least 64 MiB (below that, fixed costs swamp a per-byte figure); empty
/// when none does.
pub fn cpu_line(results: &[CaseResult]) -> String {
    let mut line = String::new();
    for r in results.iter().filter(|r| r.bytes >= 64 << 20) {
        let (k, rs) = r.cpu_per_gib();
        let _ = write!(line, " {}=kt:{k:.2},rsync:{rs:.2}", r.name);
    }
    if line.is_empty() {
        line
    } else {
        format!("cpu-s/GiB{line}")
    }
}

/// `ratio small_cold=R small_noop=R ...` in the order given (cases not run are left out).
pub fn ratio_line(results: &[CaseResult]) -> String {
    let mut line = String::from("ratio");
    for r in results {
        let _ = write!(line, " {}={:.2}", r.name, r.ratio());
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_lines() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        let rs = vec![
            CaseResult {
                name: "small_cold",
                kt: vec![1.0, 0.5, 2.0],
                rsync: vec![4.0, 4.0, 4.0],
                ..CaseResult::default()
            },
            CaseResult {
                name: "small_noop",
                kt: vec![0.1],
                rsync: vec![0.3],
                ..CaseResult::default()
            },
        ];
        assert_eq!(ratio_line(&rs), "ratio small_cold=0.25 small_noop=0.33");
        let t = table(&rs);
        assert!(t.contains("small_cold"), "{t}");
        assert_eq!(t.lines().count(), 3);
        assert_eq!(cpu_line(&rs), "");
        let large = CaseResult {
            name: "large_get",
            bytes: 1 << 30,
            kt: vec![1.0],
            rsync: vec![2.0],
            kt_cpu: vec![0.5, 0.7, 0.6],
            rsync_cpu: vec![1.5],
            ..CaseResult::default()
        };
        assert_eq!(cpu_line(&[large]), "cpu-s/GiB large_get=kt:0.60,rsync:1.50");
    }
}
