//! How busy the host's CPUs were during a step, from `/proc/stat`: a step
//! whose cores were all busy was bound by them, not by the links or the
//! design it measures (the report says so next to its time).

/// The host's cumulative CPU time, in clock ticks, at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    busy: u64,
    total: u64,
}

impl CpuTimes {
    /// The aggregate `cpu` line of `/proc/stat`; None where there is none.
    pub fn now() -> Option<CpuTimes> {
        parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// The share (0 to 1) of all cores' time that was busy since `self`;
    /// None when too little time passed to tell.
    pub fn busy_until(&self, later: &CpuTimes) -> Option<f64> {
        let total = later.total.checked_sub(self.total)?;
        let busy = later.busy.checked_sub(self.busy)?;
        (total > 0).then(|| (busy as f64 / total as f64).min(1.0))
    }
}

/// Reads the `cpu ` line: user nice system idle iowait irq softirq steal
/// (guest time is inside user already). Idle and iowait are not busy.
fn parse(stat: &str) -> Option<CpuTimes> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    if v.len() < 4 {
        return None;
    }
    let total: u64 = v.iter().sum();
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some(CpuTimes {
        busy: total - idle,
        total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busy_share_comes_from_the_aggregate_line() {
        let a = parse("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n").unwrap();
        let b = parse("cpu  250 0 100 850 50 0 0 0 0 0\n").unwrap();
        // 200 busy ticks of 250.
        assert_eq!(a.busy_until(&b), Some(0.8));
        assert_eq!(a.busy_until(&a), None);
        assert_eq!(b.busy_until(&a), None);
        assert!(parse("intr 1 2 3\n").is_none());
        assert!(parse("cpu  1 x 3 4\n").is_none());
    }

    #[test]
    fn this_host_has_a_reading() {
        if std::path::Path::new("/proc/stat").exists() {
            assert!(CpuTimes::now().is_some());
        }
    }
}
